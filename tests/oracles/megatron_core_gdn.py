"""Qwen3.5- and Qwen3-Next-style hybrid models written and read back by megatron-core's own
modules (test oracle, issue 56): gated delta net layers
(``megatron.core.ssm.gated_delta_net.GatedDeltaNet``) between gated-attention layers
(``attention_output_gate``), q/k norms, zero-centred norms, RoPE on a quarter of each head;
with ``--moe`` (Qwen3-Next) routed experts and a gated shared expert in every layer. On CPU
with gloo.

Modes (each takes ``--moe``):

``write OUT --format legacy|torch_dist [--steps 0|1] [--drift]``
    Two TP ranks build megatron-core's ``GPTModel`` with this hybrid block, randomise the
    parameters megatron-core initialises to constants, take one step of megatron-core's Adam
    (per-parameter optimizer) and save model and optimizer the way Megatron-LM does
    (legacy ``model_optim_rng.pt`` per rank, or ``dist_checkpointing.save``), with ``args`` in
    Megatron-LM's names, and megatron-core's TP forward on a fixed batch in
    ``OUT/reference.pt``.

With ``--mtp`` the model has one multi-token prediction layer (megatron-core's
``MultiTokenPredictionBlock``, built from the last layer's spec as ``get_gpt_mtp_block_spec``
builds it, its norms the TE-like zero-centred ``Norm``), and ``reference.pt`` / ``load``'s
output also hold its logits (``mtp_logits``: the output layer on the MTP layer's output, as
``GPTModel`` computes its MTP loss) and the hidden states it starts from (``hidden``).

With ``--bridge SITE --bridge-deps DIR,DIR`` the model is saved by Megatron-Bridge's own
``save_checkpoint`` instead (``megatron_bridge_save``: ``torch_dist`` with ``run_config.yaml``
and no Megatron-LM ``args``), its config's model Megatron-Bridge's ``Qwen3NextModelProvider``
with this model's sizes (``bridge_fields``).

``forward CKPT OUT_PT``
    Loads a legacy TP=1 PP=2 checkpoint into one model per stage with
    ``load_state_dict(strict=True)`` (names and megatron-core's own order checked) and saves the
    logits of the two stages run in turn.

``load CKPT OUT_PT``
    Loads a ``torch_dist`` checkpoint into the TP=2 model through megatron-core's
    ``dist_checkpointing.load`` (its own resharding: every key and box the model asks for must
    be there, and nothing else) and saves the logits.

CPU shims (megatron-core builds this block only with TransformerEngine and needs FLA):

* ``fla`` is a stand-in package: ``l2norm`` is transformers' torch form; its chunked kernel is
  never called (``deterministic_mode=True`` makes ``GatedDeltaNet`` use megatron-core's own
  ``torch_chunk_gated_delta_rule`` and plain ``conv1d``).
* TransformerEngine's modules are mirrored by megatron-core's local ones under TE's names:
  ``LayerNormColumnParallel`` is ``ColumnParallelLinear`` with TE's fused
  ``layer_norm_weight`` (registered first, RMSNorm before the product), used for
  ``linear_qkv``, ``in_proj`` and ``linear_fc1`` with the layers' own input norms
  ``IdentityOp``, as megatron-core's TE specs build them; core attention gets TE's empty
  ``_extra_state``; ``out_norm``'s gradient is summed over TP as TE's norm has it under
  sequence parallelism (see ``sum_out_norm_grads_over_tp``). The block is assembled per layer as
  ``get_transformer_block_with_experimental_attention_variant_spec`` assembles it.
"""

from __future__ import annotations

import argparse
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
NUM_LAYERS = 4
FREQ = 2
ROTARY_PERCENT = 0.25
"""``linear_attention_freq``: every 2nd layer (1-based) is an attention layer."""
BATCH, SEQ = 2, 11
GDN = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}


def cpu_patches() -> None:
    """megatron-core's CPU patches, and its router's TE-only GEMM named absent (as
    ``megatron_core_moe.py`` does: megatron-core 0.16.1 defines it only with TE)."""
    patch_megatron_for_cpu(noop_cuda_synchronize=True)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install_fla_shim() -> None:
    """A stand-in ``fla`` package (see the module docstring)."""

    def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
        return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)

    def chunk_gated_delta_rule(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("deterministic_mode uses megatron-core's torch kernel")

    modules = {
        name: types.ModuleType(name)
        for name in (
            "fla",
            "fla.modules",
            "fla.modules.l2norm",
            "fla.ops",
            "fla.ops.gated_delta_rule",
        )
    }
    modules["fla.modules.l2norm"].l2norm = l2norm  # type: ignore[attr-defined]
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = chunk_gated_delta_rule  # type: ignore[attr-defined]
    sys.modules.update(modules)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, centred: bool) -> torch.Tensor:
    """TE's RMSNorm: in fp32, scaled by ``weight`` (``1 + weight`` with zero-centred gamma)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y * ((1.0 + weight.float()) if centred else weight.float())).to(x.dtype)


class Norm(torch.nn.Module):
    """TENorm (RMSNorm) as megatron-core's TE specs build it, ``zero_centered_gamma`` from the
    config: the local ``WrappedTorchNorm`` refuses zero-centred gamma."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps, self.centred = eps, config.layernorm_zero_centered_gamma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.centred)


def te_like_modules() -> tuple[type, type]:
    """(LayerNormColumnParallel, core attention with extra state): see the module docstring."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LayerNormColumnParallel(ColumnParallelLinear):  # type: ignore[misc]
        def __init__(self, input_size: int, output_size: int, **kwargs: Any) -> None:
            super().__init__(input_size, output_size, **kwargs)
            weight = torch.nn.Parameter(torch.ones(input_size))
            own = dict(self._parameters)
            self._parameters.clear()
            self._parameters["layer_norm_weight"] = weight  # TE registers its norm first
            self._parameters.update(own)
            self.eps = kwargs["config"].layernorm_epsilon
            self.centred = kwargs["config"].layernorm_zero_centered_gamma

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            normed = rms_norm(x, self.layer_norm_weight, self.eps, self.centred)
            return super().forward(normed, *args, **kwargs)

    class CoreAttention(DotProductAttention):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # as megatron-core's local linears do: a file without it loads (legacy files
            # ckptctl writes carry no empty extra state)
            self._register_load_state_dict_pre_hook(
                lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(
                    f"{prefix}_extra_state"
                )
            )

        def get_extra_state(self) -> None:
            return None

        def set_extra_state(self, state: Any) -> None:
            pass

    return LayerNormColumnParallel, CoreAttention


MOE = {
    "num_moe_experts": 4,
    "moe_ffn_hidden_size": 32,
    "moe_router_topk": 2,
    "moe_shared_expert_intermediate_size": 48,
    "moe_shared_expert_gate": True,
    "moe_router_load_balancing_type": "none",
    "moe_aux_loss_coeff": 0.0,
    "moe_token_dispatcher_type": "allgather",
}
"""``--moe`` (Qwen3-Next's shape): routed experts in every layer (softmax over the top k, as
HF's ``norm_topk_prob``) and a shared expert behind a sigmoid gate; expert TP = TP."""


def block_spec(config: Any, layers: range, moe: bool = False) -> Any:
    """The hybrid block's layers ``layers`` (0-based global numbers); ``moe``: with routed
    experts and a gated shared expert (megatron-core's local MoE spec; its pre-MLP norm is a
    module of its own there as under TE)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    fused, core_attention = te_like_modules()
    local = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    attention = local.submodules.self_attention
    attention.submodules.linear_qkv = fused
    attention.submodules.core_attention = core_attention
    attention.submodules.q_layernorm = attention.submodules.k_layernorm = Norm
    mlp = local.submodules.mlp
    mlp.submodules.linear_fc1 = fused
    pre_mlp_norm: Any = IdentityOp
    if moe:
        mlp = get_gpt_layer_local_spec(num_experts=MOE["num_moe_experts"]).submodules.mlp
        pre_mlp_norm = Norm
    gdn = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=fused, out_norm=Norm, out_proj=RowParallelLinear
        ),
    )
    specs = [
        ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=IdentityOp,
                self_attention=attention if (i + 1) % FREQ == 0 else gdn,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=pre_mlp_norm,
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        )
        for i in layers
    ]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=Norm)


def mtp_block_spec(layer_spec: Any) -> Any:
    """One MTP layer around ``layer_spec`` (the last decoder layer's), as
    ``get_mtp_layer_spec_for_backend`` assembles it, with the zero-centred ``Norm`` that TE's
    norm is (the local backend's norm refuses zero-centred gamma)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=Norm,
            hnorm=Norm,
            eh_proj=ColumnParallelLinear,
            transformer_layer=layer_spec,
            layer_norm=Norm,
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer])


def megatron_args(
    tp: int, pp: int, ckpt_format: str, moe: bool = False, mtp: bool = False
) -> argparse.Namespace:
    """The ``args`` Megatron-LM stores for this model."""
    args = argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        **{**model_args(tp, NUM_LAYERS), "rotary_percent": ROTARY_PERCENT},
        num_experts=None,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        transformer_impl="transformer_engine",
        use_distributed_optimizer=False,
        seq_length=SEQ,
        ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format == "torch_dist",
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=FREQ,
        qk_layernorm=True,
        apply_layernorm_1p=True,  # zero-centred norms (0.19: --layernorm-zero-centered-gamma)
        **GDN,
        mtp_num_layers=1 if mtp else None,
    )
    if moe:
        for name, value in MOE.items():
            setattr(args, "num_experts" if name == "num_moe_experts" else name, value)
        args.expert_model_parallel_size, args.expert_tensor_parallel_size = 1, tp
    return args


def build(
    tp: int, pp_stage: int | None = None, moe: bool = False, mtp: bool = False
) -> torch.nn.Module:
    """The whole model, or one of two pipeline stages (half the layers each); ``mtp``: with
    an MTP layer (the whole model only)."""
    from megatron.core.models.gpt import GPTModel

    layers = range(NUM_LAYERS) if pp_stage is None else range(pp_stage * 2, pp_stage * 2 + 2)
    config = transformer_config(
        tp=tp,
        num_layers=len(layers),
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=FREQ,
        deterministic_mode=True,
        qk_layernorm=True,
        layernorm_zero_centered_gamma=True,
        **GDN,
        **(MOE if moe else {}),
        **({"mtp_num_layers": 1} if mtp else {}),
    )
    stages = (
        {} if pp_stage is None else {"pre_process": pp_stage == 0, "post_process": pp_stage == 1}
    )
    spec = block_spec(config, layers, moe)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp_block_spec(spec.layer_specs[-1]) if mtp else None,
        vocab_size=padded_vocab_size(tp),
        max_sequence_length=64,
        parallel_output=False,
        position_embedding_type="rope",
        rotary_percent=ROTARY_PERCENT,
        **stages,
    )


def randomise(model: torch.nn.Module, rank: int) -> None:
    """Norm weights ``0.1 * randn`` (zero-centred: the norms scale by about one) rounded to
    bfloat16's precision (as a bf16-trained model's are, so HF's ``1 + w`` of the gated norm is
    exact in fp32), ``dt_bias`` and ``A_log`` ``0.5 * randn`` (megatron-core initialises them to
    constants, which would hide a misplaced one), seeded by name, and by TP rank for a
    tensor-parallel shard (replicated parameters must agree over ranks)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = "norm" in name
            if not norm and not name.endswith(("dt_bias", "A_log")):
                continue
            split = getattr(param, "tensor_model_parallel", False)
            seed = NORM_SEED + zlib.crc32(f"{name}@{rank if split else 0}".encode())
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
            param.copy_((0.1 * noise).bfloat16().float() if norm else 0.5 * noise)


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    input_ids = reference_input_ids(BATCH, SEQ)
    with torch.no_grad():
        logits = model(input_ids, position_ids(BATCH, SEQ), causal_mask(SEQ))
    return logits[..., :TRUE_VOCAB].float().contiguous()


def outputs_of(model: torch.nn.Module, mtp: bool) -> Any:
    """The logits; with ``mtp`` a dict of them, the MTP layer's logits and the hidden states
    it starts from (``[batch, seq, ...]``), taken from the MTP block's input and output in
    ``GPTModel``'s own forward (which, given labels, returns only losses)."""
    if not mtp:
        return logits_of(model)
    input_ids = reference_input_ids(BATCH, SEQ)
    seen: dict[str, torch.Tensor] = {}

    def keep(module: Any, args: Any, kwargs: dict[str, Any], out: torch.Tensor) -> None:
        seen["hidden"], seen["out"] = kwargs["hidden_states"], out

    hook = model.mtp.register_forward_hook(keep, with_kwargs=True)
    with torch.no_grad():
        model(input_ids, position_ids(BATCH, SEQ), causal_mask(SEQ), labels=input_ids)
        hook.remove()
        main, extra = torch.chunk(seen["out"], 2, dim=0)
        logits = [model.output_layer(x)[0].transpose(0, 1) for x in (main, extra)]
    return {
        "logits": logits[0][..., :TRUE_VOCAB].float().contiguous(),
        "mtp_logits": logits[1][..., :TRUE_VOCAB].float().contiguous(),
        "hidden": seen["hidden"].transpose(0, 1).float().contiguous(),
    }


def sum_out_norm_grads_over_tp(model: torch.nn.Module) -> None:
    """Sum each gated delta net ``out_norm`` gradient over TP, as megatron-core's
    ``finalize_model_grads`` does for a TE norm under ``--sequence-parallel`` (how Megatron
    runs train such models; the local norm here has no sequence-parallel mode). Without it each
    rank's norm sees only its own value heads' gradient and the TP replicas drift apart
    (``--drift``: what megatron-core 0.16-0.19 does without sequence parallelism)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for name, param in model.named_parameters():
        if name.endswith("out_norm.weight"):
            param.register_hook(summed)


def bridge_fields(mtp: bool) -> dict[str, Any]:
    """Megatron-Bridge's ``Qwen3NextModelProvider`` fields for the ``--moe`` model: its sizes,
    and where the CPU model differs from the provider's defaults (megatron-core's sequential
    experts, not TE's grouped GEMM; no router aux loss, fp32 parameters)."""
    from megatron_bridge_save import model_fields

    return {
        **model_fields(NUM_LAYERS, TP),
        "max_position_embeddings": MAX_POSITIONS,
        "rotary_percent": ROTARY_PERCENT,
        "linear_attention_freq": FREQ,
        **GDN,
        **MOE,
        "moe_grouped_gemm": False,
        "expert_tensor_parallel_size": TP,
        "mtp_num_layers": 1 if mtp else None,
    }


def write_worker(
    rank: int,
    port: int,
    out_dir: Path,
    ckpt_format: str,
    drift: bool,
    steps: int,
    moe: bool,
    mtp: bool,
    bridge: list[Path] | None = None,
    distributed: str | None = None,
) -> None:
    if bridge is not None:
        from megatron_bridge_save import import_bridge

        import_bridge(bridge[0], bridge[1:])
    cpu_patches()
    with model_parallel(rank, port, TP, tp=TP, cpu_as_cuda=True):
        torch.manual_seed(MODEL_SEED)  # the same full model on every rank
        model = build(TP, moe=moe, mtp=mtp)
        randomise(model, rank)
        if not drift:
            sum_out_norm_grads_over_tp(model)
        # one step of megatron-core's Adam (per-parameter optimizer), so the state is real
        ddp, optimizer, scheduler = wrap_for_training(
            model.config, model, global_batch=BATCH, distributed=distributed is not None
        )
        model.eval()  # no dropout here anyway
        tokens = torch.randint(
            0, TRUE_VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(DATA_SEED)
        )
        for _ in range(steps):
            train_step(ddp, optimizer, scheduler, [lm_batch(tokens)], global_batch=BATCH)
        state: dict[str, Any] = {
            "args": megatron_args(TP, 1, ckpt_format, moe, mtp),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": ITERATION,
            "opt_param_scheduler": scheduler.state_dict(),
        }
        if bridge is None:
            save_trained(out_dir, rank, ckpt_format, state, model, optimizer)
        else:
            from megatron_bridge_save import save_with_bridge

            provider = "qwen.qwen_provider.Qwen3NextModelProvider"
            fields = bridge_fields(mtp)
            save_with_bridge(
                out_dir, provider, fields, ddp, optimizer, scheduler, ITERATION, distributed
            )
        outputs = outputs_of(model, mtp)
        if rank == 0:
            reference = {"input_ids": reference_input_ids(BATCH, SEQ)}
            reference |= outputs if mtp else {"logits": outputs}
            torch.save(reference, out_dir / "reference.pt")
            (out_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        dist.barrier()


def forward_worker(rank: int, port: int, ckpt: Path, out: Path, moe: bool) -> None:
    cpu_patches()
    with model_parallel(rank, port, 1, tp=1, cpu_as_cuda=True):
        inputs = (reference_input_ids(BATCH, SEQ), position_ids(BATCH, SEQ), causal_mask(SEQ))
        torch.save(pp2_logits(ckpt, lambda stage: build(1, stage, moe), inputs), out)


def load_worker(rank: int, port: int, ckpt: Path, out: Path, moe: bool, mtp: bool) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    cpu_patches()
    with model_parallel(rank, port, TP, tp=TP, cpu_as_cuda=True):
        torch.manual_seed(MODEL_SEED + 1)  # not the saved weights: the load must set them
        model = build(TP, moe=moe, mtp=mtp)
        (checkpoint_dir,) = [*ckpt.glob("iter_*"), *ckpt.glob("release")]  # any iteration
        loaded, missing, unexpected = dist_checkpointing.load(
            {"model": model.sharded_state_dict()},
            str(checkpoint_dir),
            strict=StrictHandling.RETURN_ALL,
        )
        # megatron-core's words: "unexpected" keys the model asks for and the checkpoint lacks,
        # "missing" keys the checkpoint holds and nobody asks for. Of those only the optimizer
        # state (not loaded here) and an empty TE extra state may be there (megatron-core
        # 0.16's TE core attention saves none without learnable softmax offsets; older
        # releases did), which Megatron-LM's default strictness lets pass; nothing else.
        missing = {
            key
            for key in missing
            if not key.endswith("._extra_state") and not key.startswith("optimizer.")
        }
        assert not missing and not unexpected, (sorted(missing), sorted(unexpected))
        model.load_state_dict(loaded["model"], strict=True)
        model.eval()
        outputs = outputs_of(model, mtp)
        if rank == 0:
            torch.save(outputs, out)
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    install_fla_shim()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    write = sub.add_parser("write")
    write.add_argument("out_dir", type=Path)
    write.add_argument("--format", choices=("legacy", "torch_dist"), required=True)
    write.add_argument("--drift", action="store_true", help="leave out_norm's TP replicas apart")
    write.add_argument("--steps", type=int, choices=(0, 1), default=1, help="Adam steps taken")
    write.add_argument("--moe", action="store_true", help="Qwen3-Next's routed experts (MOE)")
    write.add_argument("--mtp", action="store_true", help="one multi-token prediction layer")
    write.add_argument("--bridge", type=Path, help="Megatron-Bridge's site: save with it")
    write.add_argument("--bridge-deps", default="", help="omegaconf's sites, comma-separated")
    write.add_argument(
        "--distopt",
        choices=("dp_reshardable", "fully_reshardable"),
        help="megatron-core's distributed Adam, its state saved so (with --bridge)",
    )
    for mode in ("forward", "load"):
        read = sub.add_parser(mode)
        read.add_argument("ckpt", type=Path)
        read.add_argument("out", type=Path)
        read.add_argument("--moe", action="store_true")
        if mode == "load":
            read.add_argument("--mtp", action="store_true")
    args = parser.parse_args(argv)
    if args.mode == "write":
        args.out_dir.mkdir(parents=True, exist_ok=True)
        out = args.out_dir.resolve()
        bridge = None
        if args.bridge is not None:
            bridge = [args.bridge, *(Path(d) for d in args.bridge_deps.split(",") if d)]
        spawn(
            write_worker,
            TP,
            out,
            args.format,
            args.drift,
            args.steps,
            args.moe,
            args.mtp,
            bridge,
            args.distopt,
        )
    elif args.mode == "forward":
        spawn(forward_worker, 1, args.ckpt.resolve(), args.out.resolve(), args.moe)
    else:
        spawn(load_worker, TP, args.ckpt.resolve(), args.out.resolve(), args.moe, args.mtp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
