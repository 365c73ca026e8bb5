"""Model variants written and read back by megatron-core's own GPTModel (test oracle, issue 14).

Two modes, both on CPU with gloo:

``write OUT --format legacy|torch_dist``
    Spawns two TP ranks and, for every variant below, builds megatron-core's ``GPTModel``
    (local layer spec) with that variant's ``TransformerConfig``, randomises its norms and
    biases, and saves it the way Megatron-LM does (legacy ``model_optim_rng.pt`` per rank, or
    ``dist_checkpointing.save`` for ``torch_dist``, ``args`` as Megatron-LM stores them, with
    ``transformer_impl="local"``) to ``OUT/<variant>/``, with megatron-core's own TP forward on
    a fixed batch in ``OUT/<variant>/reference.pt``.

``write OUT --format torch_dist --bridge SITE --bridge-deps DIR,DIR``
    The same models (but ``yarn_rope``, whose fields Megatron-Bridge's GPT provider lacks) saved
    by Megatron-Bridge's own ``save_checkpoint`` (``megatron_bridge_save``: ``run_config.yaml``,
    no Megatron-LM ``args``), each described by Megatron-Bridge's ``GPTModelProvider`` with
    ``local_layer_spec`` (``bridge_fields``).

``forward CKPT OUT_PT --variant NAME``
    Loads a legacy TP=1 PP=2 checkpoint (one layer per stage) into megatron-core's model, one
    ``GPTModel`` per pipeline stage with ``load_state_dict(strict=True)``, runs the stages in
    turn (stage 0's hidden states as stage 1's input tensor) and saves the logits to ``OUT_PT``.

Variants: ``mha`` (group_query_attention off, num_query_groups stored as 1), ``partial_rope``
(rotary_percent 0.5), ``qkv_bias`` (Qwen2-style), ``qk_layernorm`` (Qwen3-style), ``gelu``
(non-gated GELU MLP), ``tied`` (shared embedding and output weights), ``sliding_window`` and
``window_pattern`` (sliding-window attention on every layer / on every other layer),
``llama3_rope`` and ``yarn_rope`` (RoPE scaling), ``off_by_one`` (``softmax_type``).
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_cpu import (
    CHECKPOINT_VERSION,
    ITERATION,
    MODEL_SEED,
    NORM_SEED,
    NUM_HEADS,
    TRUE_VOCAB,
    causal_mask,
    gpt_model,
    model_args,
    model_parallel,
    patch_megatron_for_cpu,
    position_ids,
    reference_input_ids,
    spawn,
    transformer_config,
)

TP = 2
NUM_LAYERS = 2
BATCH, SEQ = 2, 17
WINDOW = (3, 0)

# variant -> (args overrides as Megatron-LM stores them, TransformerConfig overrides, GPTModel
# keywords)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "mha": (
        {"group_query_attention": False, "num_query_groups": 1},
        {"num_query_groups": NUM_HEADS},
        {},
    ),
    "partial_rope": ({"rotary_percent": 0.5}, {}, {"rotary_percent": 0.5}),
    "qkv_bias": ({"add_qkv_bias": True}, {"add_qkv_bias": True}, {}),
    "qk_layernorm": ({"qk_layernorm": True}, {"qk_layernorm": True}, {}),
    "gelu": (
        {"swiglu": False},
        {"gated_linear_unit": False, "activation_func": torch.nn.functional.gelu},
        {},
    ),
    "tied": ({"untie_embeddings_and_output_weights": False}, {}, {"tie_embeddings": True}),
    # Sliding-window attention (issue 56): a window of 4 keys on every layer (Mistral), and on
    # layer 1 only with q/k norms (window_attn_skip_freq=2: every 2nd layer attends fully;
    # Qwen3 with layer_types). SEQ is longer than the window.
    "sliding_window": ({"window_size": WINDOW}, {"window_size": WINDOW}, {}),
    "window_pattern": (
        {"window_size": WINDOW, "window_attn_skip_freq": 2, "qk_layernorm": True},
        {"window_size": WINDOW, "window_attn_skip_freq": 2, "qk_layernorm": True},
        {},
    ),
    # An off-by-one softmax (issue 56): a 1 in every denominator, no tensor; no HF class.
    "off_by_one": ({"softmax_type": "off-by-one"}, {"softmax_type": "off-by-one"}, {}),
    # RoPE scaling (issue 56): Llama 3.1's (megatron-core fixes its other numbers at 1, 4 and
    # 8192; a base of 500000 puts half the frequencies past its wavelengths), and YaRN x4 from
    # a context of 16 (MAX_POSITIONS is 64), as Megatron-LM's args and GPTModel say them.
    "llama3_rope": (
        {"use_rope_scaling": True, "rope_scaling_factor": 8.0, "rotary_base": 500000},
        {},
        {"rope_scaling": True, "rope_scaling_factor": 8.0, "rotary_base": 500000},
    ),
    "yarn_rope": (
        {
            "position_embedding_type": "yarn",
            "rotary_scaling_factor": 4.0,
            "yarn_original_max_position_embeddings": 16,
            "yarn_beta_fast": 32.0,
            "yarn_beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
            "yarn_correction_range_round_to_int": True,
        },
        {},
        {"position_embedding_type": "yarn"},
    ),
}
YARN_CONFIG = {
    "yarn_rotary_scaling_factor": 4.0,
    "yarn_original_max_position_embeddings": 16,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_mscale": 1.0,
    "yarn_mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": True,
}
"""What Megatron-LM 0.19's ``_apply_yarn_config_from_args`` sets on the TransformerConfig for
``yarn_rope``'s args (megatron-core 0.16.1 declares no such fields; GPTModel reads them)."""


def megatron_args(variant: str, tp: int, pp: int, ckpt_format: str) -> argparse.Namespace:
    """The ``args`` Megatron-LM stores for this variant."""
    args = argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        **model_args(tp, NUM_LAYERS),
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
    for name, value in VARIANTS[variant][0].items():
        setattr(args, name, value)
    return args


def build(variant: str, tp: int, pp_stage: int | None = None) -> torch.nn.Module:
    """The variant's GPTModel: the whole model, or one of two pipeline stages (one layer each)."""
    _, config_overrides, model_kwargs = VARIANTS[variant]
    layers = NUM_LAYERS if pp_stage is None else NUM_LAYERS // 2
    freq = config_overrides.get("window_attn_skip_freq")
    if pp_stage is not None and freq is not None:
        # A stage built alone numbers its layers from 1 (no pipeline group here): give it its
        # part of the whole model's window pattern (1: windowed), as megatron-core's offsets
        # would in a PP2 run.
        pattern = [int(n % freq != 0) for n in range(1, NUM_LAYERS + 1)]
        stage_pattern = pattern[pp_stage * layers : (pp_stage + 1) * layers]
        config_overrides = {**config_overrides, "window_attn_skip_freq": stage_pattern}
    config = transformer_config(tp=tp, num_layers=layers, **config_overrides)
    stages = (
        {} if pp_stage is None else {"pre_process": pp_stage == 0, "post_process": pp_stage == 1}
    )
    if model_kwargs.get("position_embedding_type") == "yarn":
        for name, value in YARN_CONFIG.items():
            setattr(config, name, value)
    return gpt_model(config, parallel_output=False, **stages, **model_kwargs)


def randomise(model: torch.nn.Module, rank: int) -> None:
    """Norm weights ``1 + 0.1 * randn`` and biases ``0.1 * randn`` (megatron-core initialises
    them to ones and zeros, which would hide a misplaced one), seeded by name, and by TP rank
    too for a tensor-parallel shard (replicated parameters must agree over ranks)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = "layernorm" in name
            if not norm and not name.endswith(".bias"):
                continue
            split = getattr(param, "tensor_model_parallel", False)
            seed = NORM_SEED + zlib.crc32(f"{name}@{rank if split else 0}".encode())
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
            param.copy_(1.0 + 0.1 * noise if norm else 0.1 * noise)


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    input_ids = reference_input_ids(BATCH, SEQ)
    with torch.no_grad():
        logits = model(input_ids, position_ids(BATCH, SEQ), causal_mask(SEQ))
    return logits[..., :TRUE_VOCAB].float().contiguous()


BRIDGE_MODEL_KWARGS = {"tie_embeddings": "share_embeddings_and_output_weights"}
"""GPTModel keywords the provider names otherwise (the rest are the provider's names too)."""


def bridge_fields(variant: str) -> dict[str, Any]:
    """Megatron-Bridge's ``GPTModelProvider`` fields for the variant's model: the model's
    sizes, its TransformerConfig overrides and GPTModel keywords, megatron-core's local layer
    spec, fp32 parameters."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron_bridge_save import model_fields

    _, config_overrides, model_kwargs = VARIANTS[variant]
    fields = model_fields(NUM_LAYERS, TP)
    fields |= {"transformer_layer_spec": local_layer_spec, **config_overrides}
    for name, value in model_kwargs.items():
        fields[BRIDGE_MODEL_KWARGS.get(name, name)] = value
    return fields


def write_worker(
    rank: int, port: int, out_dir: Path, ckpt_format: str, bridge: list[Path] | None = None
) -> None:
    if bridge is not None:
        from megatron_bridge_save import import_bridge, save_with_bridge

        import_bridge(bridge[0], bridge[1:])
    patch_megatron_for_cpu(noop_cuda_synchronize=True)
    # CpuAsCudaMode: dist_checkpointing, and the sliding-window mask (made on "cuda")
    with model_parallel(rank, port, TP, tp=TP, cpu_as_cuda=True):
        for variant in VARIANTS:
            if bridge is not None and variant == "yarn_rope":
                continue
            torch.manual_seed(MODEL_SEED)  # the same full model on every rank (see gpt_model)
            model = build(variant, TP)
            randomise(model, rank)
            model.eval()
            root = out_dir / variant
            args = megatron_args(variant, TP, 1, ckpt_format)
            if bridge is not None:
                provider = "gpt_provider.GPTModelProvider"
                save_with_bridge(
                    root, provider, bridge_fields(variant), model, None, None, ITERATION
                )
            elif ckpt_format == "legacy":
                rank_dir = root / f"iter_{ITERATION:07d}" / f"mp_rank_{rank:02d}"
                rank_dir.mkdir(parents=True, exist_ok=True)
                state = {
                    "args": args,
                    "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint(),
                }
                torch.save(state, rank_dir / "model_optim_rng.pt")
            else:
                save_torch_dist(root, model, args)
            logits = logits_of(model)
            if rank == 0:
                reference = {"input_ids": reference_input_ids(BATCH, SEQ), "logits": logits}
                torch.save(reference, root / "reference.pt")
                (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
            dist.barrier()


def save_torch_dist(root: Path, model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Megatron-LM's synchronous ``torch_dist`` save of the model alone."""
    from megatron.core import dist_checkpointing

    checkpoint_dir = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": ITERATION,
        "model": model.sharded_state_dict(),
    }
    dist_checkpointing.save(state, str(checkpoint_dir))
    dist.barrier()


def forward_worker(rank: int, port: int, ckpt: Path, out: Path, variant: str) -> None:
    patch_megatron_for_cpu(noop_cuda_synchronize=False)
    with model_parallel(rank, port, 1, tp=1, cpu_as_cuda=True):  # the window's mask
        stages = []
        for stage in range(2):
            model = build(variant, 1, pp_stage=stage)
            path = ckpt / f"iter_{ITERATION:07d}" / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt"
            state = torch.load(path, weights_only=False)
            assert state["args"].pipeline_model_parallel_size == 2
            # strict: every parameter megatron-core's stage has, named as it names them, and
            # nothing else (extra state aside, which the local spec does not have).
            model.load_state_dict(state["model"], strict=True)
            # ... and in megatron-core's own order (the order Megatron numbers optimizer state by).
            ours = [k for k in state["model"] if not k.endswith("_extra_state")]
            theirs = [k for k in model.state_dict() if not k.endswith("_extra_state")]
            assert ours == theirs, (ours, theirs)
            model.eval()
            stages.append(model)
        input_ids = reference_input_ids(BATCH, SEQ)
        with torch.no_grad():
            hidden = stages[0](input_ids, position_ids(BATCH, SEQ), causal_mask(SEQ))
            stages[1].set_input_tensor(hidden)
            logits = stages[1](input_ids, position_ids(BATCH, SEQ), causal_mask(SEQ))
        torch.save(logits[..., :TRUE_VOCAB].float().contiguous(), out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    write = sub.add_parser("write")
    write.add_argument("out_dir", type=Path)
    write.add_argument("--format", choices=("legacy", "torch_dist"), required=True)
    write.add_argument("--bridge", type=Path, help="Megatron-Bridge's site: save with it")
    write.add_argument("--bridge-deps", default="", help="omegaconf's sites, comma-separated")
    forward = sub.add_parser("forward")
    forward.add_argument("ckpt", type=Path)
    forward.add_argument("out", type=Path)
    forward.add_argument("--variant", choices=tuple(VARIANTS), required=True)
    args = parser.parse_args(argv)
    if args.mode == "write":
        args.out_dir.mkdir(parents=True, exist_ok=True)
        bridge = None
        if args.bridge is not None:
            bridge = [args.bridge, *(Path(d) for d in args.bridge_deps.split(",") if d)]
        spawn(write_worker, TP, args.out_dir.resolve(), args.format, bridge)
    else:
        spawn(forward_worker, 1, args.ckpt.resolve(), args.out.resolve(), args.variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
