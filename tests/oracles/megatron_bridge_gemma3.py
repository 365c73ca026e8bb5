"""Gemma 3 as Megatron-Bridge builds it on megatron-core, written and read back (test oracle,
issue 56).

megatron-core 0.16.1 has no Gemma 3 layer; Megatron-Bridge 0.3.1's ``gemma3_provider`` builds
one from megatron-core's ``GPTModel``: its ``Gemma3SelfAttention`` (local or global RoPE per
layer), ``Gemma3TEDotProductAttention`` (a window on the local layers), ``Gemma3RotaryEmbedding``
(a base per layer kind, the global one divided by a linear factor),
``Gemma3LanguageModelEmbedding`` (scaled by ``sqrt(hidden)``) and ``TERowParallelLinearLayerNorm``
(a norm after attention's and the MLP's output projections). Those classes are Megatron-Bridge's
own, loaded from its wheel's source file. CPU shims, as TransformerEngine cannot run here:

* the module's TransformerEngine bases are megatron-core's local ones (``TERowParallelLinear``
  -> ``RowParallelLinear``, ``TEDotProductAttention`` -> ``DotProductAttention``), its
  ``GPTModelProvider`` base an empty dataclass (the provider itself is not used: ``build``
  does what its ``provide`` does);
* ``TENorm`` with ``layernorm_zero_centered_gamma`` (no local megatron-core norm has it) is
  ``ZeroCenteredRMSNorm`` below: ``x / rms(x) * (1 + w)`` in float32.

Megatron-Bridge keeps the model's description in its own ``run_config.yaml``, which ckptctl does
not read; the ``args`` written here are the ones ckptctl records for Gemma 3 (Megatron-LM's
names where it has them, ``ckptctl_*`` for the rest). Megatron-Bridge maps HF's
``sliding_window = W`` to a window of ``(W, 0)``; transformers attends to the last ``W`` keys,
megatron-core's ``(W - 1, 0)``: the window here is given as megatron-core's left size.

``write OUT --format legacy|torch_dist --bridge SITE``: two TP ranks build the model (6 layers,
two local then one global, as ``interleaved_attn_pattern = (2, 1)``), randomise the norms, take
one step of megatron-core's Adam (``mcore_cpu.wrap_for_training``), save model and optimizer as
Megatron-LM does, and the TP forward's logits on a fixed batch go to ``OUT/reference.pt``.

``forward CKPT OUT_PT --bridge SITE``: loads a legacy TP1 PP2 checkpoint stage by stage (strict, in
megatron-core's order) and saves the logits.

``load CKPT OUT_PT --bridge SITE``: two TP ranks load a ``torch_dist`` TP2 checkpoint with
megatron-core's ``dist_checkpointing.load`` and save the logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import types
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_checkpoints import pp2_logits, save_trained
from mcore_cpu import (
    CHECKPOINT_VERSION,
    DATA_SEED,
    ITERATION,
    MAX_POSITIONS,
    MODEL_SEED,
    NORM_EPS,
    NORM_SEED,
    TRUE_VOCAB,
    causal_mask,
    lm_batch,
    model_args,
    model_parallel,
    padded_vocab_size,
    patch_megatron_for_cpu,
    position_ids,
    reference_input_ids,
    spawn,
    train_step,
    transformer_config,
    wrap_for_training,
)

TP = 2
NUM_LAYERS = 6
PATTERN = (2, 1)
"""Two local layers, then a global one: each PP2 stage of three layers numbers them alike."""
WINDOW_LEFT = 3
LOCAL_BASE, GLOBAL_BASE, LINEAR_FACTOR = 10_000, 1_000_000, 8.0
QUERY_PRE_ATTN_SCALAR = 24
BATCH, SEQ = 2, 17

ARGS = {
    "swiglu": False,
    "ckptctl_activation": "geglu_tanh",
    "apply_layernorm_1p": True,
    "qk_layernorm": True,
    "untie_embeddings_and_output_weights": False,
    "rotary_base": GLOBAL_BASE,
    "ckptctl_local_rotary_base": float(LOCAL_BASE),
    "ckptctl_rope_linear_factor": LINEAR_FACTOR,
    "window_size": (WINDOW_LEFT, 0),
    "window_attn_skip_freq": sum(PATTERN),
    "ckptctl_post_sublayer_norms": True,
    "ckptctl_scaled_embedding": True,
    "ckptctl_softmax_scale": QUERY_PRE_ATTN_SCALAR**-0.5,
}
"""What ckptctl records for this model (Megatron-LM's names, and its own)."""


class ZeroCenteredRMSNorm(torch.nn.Module):
    """CPU stand-in for TransformerEngine's RMSNorm with ``zero_centered_gamma``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.weight.sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def gemma3_module(site: Path) -> types.ModuleType:
    """Megatron-Bridge's ``gemma3_provider`` loaded from its source, over the shims above."""
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    local = {
        "TENorm": ZeroCenteredRMSNorm,
        "TERowParallelLinear": RowParallelLinear,
        "TEDotProductAttention": DotProductAttention,
        "TELayerNormColumnParallelLinear": None,  # the provider's spec, unused here
    }
    stubs = {
        "megatron.bridge": [],
        "megatron.bridge.models": [],
        "megatron.bridge.models.gpt_provider": [],
        "megatron.bridge.utils": [],
        "megatron.bridge.utils.import_utils": [],
    }
    for name in stubs:
        sys.modules[name] = types.ModuleType(name)

    @dataclasses.dataclass
    class GPTModelProvider:
        pass

    sys.modules["megatron.bridge.models.gpt_provider"].GPTModelProvider = GPTModelProvider  # type: ignore[attr-defined]
    sys.modules["megatron.bridge.utils.import_utils"].safe_import_from = (  # type: ignore[attr-defined]
        lambda module, name: (local[name], True)
    )
    path = site / "megatron" / "bridge" / "models" / "gemma" / "gemma3_provider.py"
    spec = importlib.util.spec_from_file_location("gemma3_provider", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config(tp: int, layers: int) -> Any:
    from megatron.core.activations import fast_gelu  # Gemma3ModelProvider's

    made = transformer_config(
        tp=tp,
        num_layers=layers,
        gated_linear_unit=True,
        activation_func=fast_gelu,
        qk_layernorm=True,
        layernorm_zero_centered_gamma=True,
        softmax_scale=QUERY_PRE_ATTN_SCALAR**-0.5,
    )
    # Gemma3ModelProvider's fields its layers read
    made.window_size = WINDOW_LEFT
    made.interleaved_attn_pattern = PATTERN
    made.is_vision_language = False
    return made


def build(gemma3: types.ModuleType, tp: int, stage: int | None = None) -> torch.nn.Module:
    """The model as ``Gemma3ModelProvider.provide`` makes it, on the local layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = NUM_LAYERS if stage is None else NUM_LAYERS // 2
    cfg = config(tp, layers)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    sub.self_attention.module = gemma3.Gemma3SelfAttention
    attention = sub.self_attention.submodules
    attention.core_attention = gemma3.Gemma3TEDotProductAttention
    attention.linear_proj = gemma3.TERowParallelLinearLayerNorm
    attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm
    sub.mlp.submodules.linear_fc2 = gemma3.TERowParallelLinearLayerNorm
    stages = {} if stage is None else {"pre_process": stage == 0, "post_process": stage == 1}
    # the final norm zero-centred too (TENorm in Megatron-Bridge)
    block = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=ZeroCenteredRMSNorm)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=block,
        vocab_size=padded_vocab_size(tp),
        max_sequence_length=MAX_POSITIONS,
        parallel_output=False,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        rotary_base=LOCAL_BASE,
        **stages,
    )
    if hasattr(model, "embedding"):
        model.embedding = gemma3.Gemma3LanguageModelEmbedding(
            config=cfg,
            vocab_size=padded_vocab_size(tp),
            max_sequence_length=MAX_POSITIONS,
            position_embedding_type="rope",
        )
    model.rotary_pos_emb = gemma3.Gemma3RotaryEmbedding(
        kv_channels=cfg.kv_channels,
        rotary_percent=1.0,
        rotary_interleaved=False,
        seq_len_interpolation_factor=None,
        rotary_base=GLOBAL_BASE,
        rope_scaling=False,
        rope_scaling_factor=LINEAR_FACTOR,
        use_cpu_initialization=True,
        rotary_base_local=LOCAL_BASE,
    )
    model.setup_embeddings_and_output_layer()
    return model


def randomise(model: torch.nn.Module, rank: int) -> None:
    """Norm weights ``0.1 * randn`` (zero-centred: 0 is the identity, which would hide a
    misplaced norm), seeded by name."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                seed = NORM_SEED + zlib.crc32(name.encode())
                generator = torch.Generator().manual_seed(seed)
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def megatron_args(tp: int, ckpt_format: str) -> argparse.Namespace:
    args = argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **model_args(tp, NUM_LAYERS, tie_embeddings=True),
        num_experts=None,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        transformer_impl="local",
        use_distributed_optimizer=False,
        seq_length=SEQ,
        ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format == "torch_dist",
    )
    for name, value in ARGS.items():
        setattr(args, name, value)
    return args


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(reference_input_ids(BATCH, SEQ), position_ids(BATCH, SEQ), causal_mask(SEQ))
    return out


def write_worker(rank: int, port: int, site: Path, out_dir: Path, ckpt_format: str) -> None:
    patch_megatron_for_cpu(noop_cuda_synchronize=True)
    with model_parallel(rank, port, TP, tp=TP, cpu_as_cuda=True):
        gemma3 = gemma3_module(site)
        torch.manual_seed(MODEL_SEED)
        model = build(gemma3, TP)
        randomise(model, rank)
        # one step of megatron-core's Adam (per-parameter optimizer), so the state is real
        ddp, optimizer, scheduler = wrap_for_training(
            model.config, model, global_batch=BATCH, distributed=False
        )
        model.eval()  # no dropout here anyway
        tokens = torch.randint(
            0, TRUE_VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(DATA_SEED)
        )
        train_step(ddp, optimizer, scheduler, [lm_batch(tokens)], global_batch=BATCH)
        args = megatron_args(TP, ckpt_format)
        state: dict[str, Any] = {
            "args": args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": ITERATION,
            "opt_param_scheduler": scheduler.state_dict(),
        }
        save_trained(out_dir, rank, ckpt_format, state, model, optimizer)
        logits = logits_of(model)[..., :TRUE_VOCAB].float().contiguous()
        if rank == 0:
            reference = {"input_ids": reference_input_ids(BATCH, SEQ), "logits": logits}
            torch.save(reference, out_dir / "reference.pt")
            (out_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        dist.barrier()


def forward_worker(rank: int, port: int, site: Path, ckpt: Path, out: Path) -> None:
    patch_megatron_for_cpu(noop_cuda_synchronize=False)
    with model_parallel(rank, port, 1, tp=1, cpu_as_cuda=True):  # the window's mask
        gemma3 = gemma3_module(site)
        inputs = (reference_input_ids(BATCH, SEQ), position_ids(BATCH, SEQ), causal_mask(SEQ))
        torch.save(pp2_logits(ckpt, lambda stage: build(gemma3, 1, stage), inputs), out)


def load_worker(rank: int, port: int, site: Path, ckpt: Path, out: Path) -> None:
    """The TP2 model loaded from a ``torch_dist`` checkpoint by megatron-core's own
    ``dist_checkpointing.load`` (every key it asks for must be there), its logits saved."""
    patch_megatron_for_cpu(noop_cuda_synchronize=True)
    with model_parallel(rank, port, TP, tp=TP, cpu_as_cuda=True):
        from megatron.core import dist_checkpointing

        gemma3 = gemma3_module(site)
        model = build(gemma3, TP)
        checkpoint_dir = ckpt / f"iter_{ITERATION:07d}"
        state, _, unexpected = dist_checkpointing.load(
            {"model": model.sharded_state_dict()}, str(checkpoint_dir), strict="return_all"
        )
        assert not unexpected, sorted(map(str, unexpected))
        model.load_state_dict(state["model"], strict=True)
        logits = logits_of(model.eval())[..., :TRUE_VOCAB].float().contiguous()
        if rank == 0:
            torch.save(logits, out)
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    write = sub.add_parser("write")
    write.add_argument("out_dir", type=Path)
    write.add_argument("--format", choices=("legacy", "torch_dist"), required=True)
    forward = sub.add_parser("forward")
    forward.add_argument("ckpt", type=Path)
    forward.add_argument("out", type=Path)
    load = sub.add_parser("load")
    load.add_argument("ckpt", type=Path)
    load.add_argument("out", type=Path)
    for mode in (write, forward, load):
        mode.add_argument("--bridge", type=Path, required=True, help="Megatron-Bridge's site")
    args = parser.parse_args(argv)
    if args.mode == "write":
        args.out_dir.mkdir(parents=True, exist_ok=True)
        spawn(write_worker, TP, args.bridge, args.out_dir.resolve(), args.format)
    elif args.mode == "load":
        spawn(load_worker, TP, args.bridge, args.ckpt.resolve(), args.out.resolve())
    else:
        spawn(forward_worker, 1, args.bridge, args.ckpt.resolve(), args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
