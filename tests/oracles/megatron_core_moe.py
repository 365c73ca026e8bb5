"""Mixture-of-experts checkpoints written and read back by megatron-core's own GPTModel (test
oracle, issue 15).

Two modes, on CPU with gloo, ``--tp T --ep E [--etp X]`` over the fewest ranks holding both
decompositions (lcm(T, E * X); data parallelism fills the rest):

``write OUT --tp T --ep E [--etp X]``
    For every variant below builds megatron-core's ``GPTModel`` with routed experts
    (``SequentialMLP``, local layer spec), trains it one Adam step with megatron-core's own
    per-parameter optimizer (a ``ChainedOptimizer`` of dense and expert parameters when E > 1),
    and saves it as Megatron-LM's legacy format does: ``model_optim_rng.pt`` in
    ``mp_rank_TT[_EEE]`` from each rank of expert-DP rank 0, with ``args``, model, optimizer
    and scheduler, to ``OUT/<variant>/``, with megatron-core's own forward on a fixed batch in
    ``OUT/<variant>/reference.pt``.

``forward CKPT OUT_PT --tp T --ep E --variant NAME``
    Loads a checkpoint of that layout into the variant's model: legacy files with
    ``load_state_dict(strict=True)`` (and megatron-core's parameter order), ``torch_dist`` with
    ``dist_checkpointing.load`` (every key the model asks for present); runs the fixed batch
    and saves the logits to ``OUT_PT``.

Variants (each maps onto one transformers class): ``mixtral`` (top-2 of 4, renormalised),
``qwen2_moe`` (softmax before top-k, q/k/v biases, a shared expert with a sigmoid gate),
``qwen3_moe`` (q/k layernorm, renormalised top-k), ``gpt_oss`` (biases everywhere, attention
sinks, clamped quick-GEGLU experts, a sliding window on every other layer, YaRN);
``--variants`` picks some.

``write --format torch_dist --bridge SITE --bridge-deps DIR,DIR`` saves each trained model with
Megatron-Bridge's own ``save_checkpoint`` instead (``megatron_bridge_save``: ``run_config.yaml``,
no Megatron-LM ``args``), described by Megatron-Bridge's ``GPTOSSProvider`` for ``gpt_oss`` and
its ``GPTModelProvider`` for the others, with ``local_layer_spec`` (``bridge_provider``).

``--grouped`` builds the experts as megatron-core's legacy ``GroupedMLP`` (``--moe-grouped-gemm``
without TransformerEngine: ``mlp.experts.weight1/weight2``), which trains only in bf16, so
``write --grouped`` makes a bf16 model (mixed-precision optimizer with fp32 masters); forwards
run in fp32 (the bf16 weights loaded into fp32 parameters) unless ``--bf16``. The grouped
GEMM kernel package does not build on CPU: its one operation is supplied as a per-expert matmul
(``cpu_grouped_gemm``); the weights' layout and the views the module takes of them are
megatron-core's own.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from mcore_cpu import (
    CHECKPOINT_VERSION,
    ITERATION,
    MODEL_SEED,
    TRUE_VOCAB,
    adam_args,
    causal_mask,
    lm_batch,
    model_args,
    model_parallel,
    patch_megatron_for_cpu,
    position_ids,
    randomise_norms,
    reference_input_ids,
    spawn,
    train_step,
    transformer_config,
    wrap_for_training,
)

NUM_LAYERS = 2
NUM_EXPERTS = 4
EXPERT_FFN = 32
BATCH, SEQ = 2, 13
TRAIN_SEED = 99

# variant -> (args as Megatron-LM stores them, TransformerConfig fields)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "mixtral": ({}, {}),
    "qwen2_moe": (
        {
            "add_qkv_bias": True,
            "moe_router_pre_softmax": True,
            "moe_shared_expert_intermediate_size": 48,
            "moe_shared_expert_gate": True,
        },
        {
            "add_qkv_bias": True,
            "moe_router_pre_softmax": True,
            "moe_shared_expert_intermediate_size": 48,
            "moe_shared_expert_gate": True,
        },
    ),
    "qwen3_moe": ({"qk_layernorm": True}, {"qk_layernorm": True}),
    # GPT-OSS (issue 56): biases on every linear (router and experts too), learned attention
    # sinks, GPT-OSS's clamped quick-GEGLU (up + 1), a window of 4 on layer 1 of 2, YaRN x4.
    "gpt_oss": (
        {
            "swiglu": False,
            "quick_geglu": True,
            "glu_linear_offset": 1.0,
            "activation_func_clamp_value": 7.0,
            "add_bias_linear": True,
            "softmax_type": "learnable",
            "window_size": (3, 0),
            "window_attn_skip_freq": 2,
            "position_embedding_type": "yarn",
            "rotary_scaling_factor": 4.0,
            "yarn_original_max_position_embeddings": 16,
            "yarn_beta_fast": 32.0,
            "yarn_beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
            "yarn_correction_range_round_to_int": False,
        },
        {
            "activation_func": "quick_gelu",
            "glu_linear_offset": 1.0,
            "activation_func_clamp_value": 7.0,
            "add_bias_linear": True,
            "softmax_type": "learnable",
            "window_size": (3, 0),
            "window_attn_skip_freq": 2,
        },
    ),
}
YARN = {
    "yarn_rotary_scaling_factor": 4.0,
    "yarn_original_max_position_embeddings": 16,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_mscale": 1.0,
    "yarn_mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": False,
}
"""GPT-OSS's YaRN on the TransformerConfig, as Megatron-LM 0.19's ``_apply_yarn_config_from_args``
sets it from the args above (megatron-core 0.16.1 declares no such fields; GPTModel reads them)."""


def moe_fields(tp: int, ep: int) -> dict[str, Any]:
    return {
        "num_moe_experts": NUM_EXPERTS,
        "moe_ffn_hidden_size": EXPERT_FFN,
        "moe_router_topk": 2,
        "expert_model_parallel_size": ep,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "allgather",
    }


def megatron_args(
    variant: str, tp: int, ep: int, etp: int, grouped: bool = False, bf16: bool = False
) -> argparse.Namespace:
    world = world_size(tp, ep, etp)
    args = argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_size=world // tp,
        world_size=world,
        **model_args(tp, NUM_LAYERS),
        num_experts=NUM_EXPERTS,
        moe_ffn_hidden_size=EXPERT_FFN,
        moe_router_topk=2,
        moe_grouped_gemm=grouped,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        fp16=False,
        accumulate_allreduce_grads_in_fp32=bf16,
        transformer_impl="local",
        use_distributed_optimizer=False,
        seq_length=SEQ,
        ckpt_format="torch",
        **adam_args(),
    )
    for name, value in VARIANTS[variant][0].items():
        setattr(args, name, value)
    return args


def build(
    variant: str,
    tp: int,
    ep: int,
    etp: int | None = None,
    grouped: bool = False,
    bf16: bool = False,
) -> torch.nn.Module:
    from mcore_cpu import MAX_POSITIONS, ROTARY_BASE, padded_vocab_size
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    fields = {**moe_fields(tp, ep), **VARIANTS[variant][1]}
    if fields.get("activation_func") == "quick_gelu":
        from megatron.core.activations import quick_gelu

        fields["activation_func"] = quick_gelu
    fields["expert_tensor_parallel_size"] = tp if etp is None else etp
    fields["moe_grouped_gemm"] = grouped
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = transformer_config(tp=tp, num_layers=NUM_LAYERS, dtype=dtype, **fields)
    yarn = VARIANTS[variant][0].get("position_embedding_type") == "yarn"
    for name, value in YARN.items() if yarn else ():
        setattr(config, name, value)
    spec = get_gpt_layer_local_spec(
        num_experts=NUM_EXPERTS,
        moe_grouped_gemm=grouped,
        normalization="RMSNorm",
        qk_layernorm=config.qk_layernorm,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(tp),
        max_sequence_length=MAX_POSITIONS,
        parallel_output=True,  # the training loss is vocab-parallel; logits_of gathers
        position_embedding_type="yarn" if yarn else "rope",
        rotary_base=ROTARY_BASE,
    )
    # GroupedMLP asserts the bf16 flag, which nothing else in it reads: an fp32 forward keeps
    # the flag on the experts alone.
    for module in model.modules():
        if type(module).__name__ == "GroupedMLP" and not module.config.bf16:
            module.config = copy.copy(module.config)
            module.config.bf16 = True
    return model


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    input_ids = reference_input_ids(BATCH, SEQ)
    with torch.no_grad():
        logits = model(input_ids, position_ids(BATCH, SEQ), causal_mask(SEQ))
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)  # the whole vocabulary
    return logits[..., :TRUE_VOCAB].float().contiguous()


def rank_dir(tp_rank: int, ep_rank: int, ep: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{ep_rank:03d}" if ep > 1 else "")


def world_size(tp: int, ep: int, etp: int) -> int:
    """The fewest ranks that hold both decompositions: tp x dp = etp x ep x expert-dp."""
    return math.lcm(tp, ep * etp)


def expert_parallel(rank: int, port: int, tp: int, ep: int, etp: int) -> Any:
    """This rank's process group for TP, EP and expert TP (experts take DP ranks)."""
    return model_parallel(
        rank,
        port,
        world_size(tp, ep, etp),
        tp=tp,
        cpu_as_cuda=True,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def cpu_patches() -> None:
    patch_megatron_for_cpu(noop_cuda_synchronize=True)
    # Without TransformerEngine megatron-core 0.16.1's moe_utils never defines te_general_gemm,
    # and the router's gating linear names it: define it as absent.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.grouped_gemm = SimpleNamespace(ops=SimpleNamespace(gmm=cpu_grouped_gemm))
    grouped_gemm_util.ops = grouped_gemm_util.grouped_gemm.ops


def cpu_grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False
) -> torch.Tensor:
    """The grouped GEMM of the ``grouped_gemm`` package: rows of ``a`` in consecutive groups of
    ``batch_sizes``, group i multiplied by ``b[i]`` (transposed if asked)."""
    out, start = [], 0
    for i, rows in enumerate(batch_sizes.tolist()):
        weight = b[i].t() if trans_b else b[i]
        out.append(a[start : start + rows] @ weight)
        start += rows
    return torch.cat(out)


def live_state(optimizer: Any, model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's fp32 master and Adam moments (local shape) from the live distributed
    optimizer(s): the sub-optimizer holding it fills the slice this rank owns (megatron-core's
    own range map), the slices are summed over that optimizer's DP group, and a count proves
    every element owned exactly once."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    out = {}
    for name, param in model.named_parameters():
        # Expert-parallel parameters (allreduce off) belong to the second, expert optimizer.
        owner = subs[-1] if not getattr(param, "allreduce", True) else subs[0]
        full = {k: torch.zeros(param.numel()) for k in ("param", "exp_avg", "exp_avg_sq")}
        cover = torch.zeros(param.numel(), dtype=torch.int32)
        if param in owner.model_param_gbuf_map:
            owned = owner._get_model_param_range_map(param)["param"]
            tensors = owner._get_main_param_and_optimizer_states(param)
            for key, value in full.items():
                value[owned.start : owned.end] = tensors[key].detach().float().view(-1)
            cover[owned.start : owned.end] += 1
        for tensor in (*full.values(), cover):
            dist.all_reduce(tensor, group=owner.data_parallel_group)
        assert bool((cover == 1).all()), name
        out[name] = {k: v.view(param.shape) for k, v in full.items()}
    return out


def save_torch_dist(root: Path, model: Any, optimizer: Any, scheduler: Any, args: Any) -> None:
    """Megatron-LM's synchronous ``torch_dist`` save: model and (fully reshardable) optimizer."""
    from megatron.core import dist_checkpointing

    checkpoint_dir = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model_state = model.sharded_state_dict()
    state = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": ITERATION,
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state),
        "opt_param_scheduler": scheduler.state_dict(),
    }
    dist_checkpointing.save(state, str(checkpoint_dir))
    dist.barrier()


def bridge_provider(variant: str, tp: int, ep: int, etp: int) -> tuple[str, dict[str, Any]]:
    """Megatron-Bridge's provider (``module.Class`` under ``megatron.bridge.models``) and its
    fields for the variant's model as ``build`` makes it (fp32, sequential experts)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron_bridge_save import model_fields

    fields = model_fields(NUM_LAYERS, tp) | {
        "expert_tensor_parallel_size": etp,
        "transformer_layer_spec": local_layer_spec,
        "moe_grouped_gemm": False,
        **moe_fields(tp, ep),
        **VARIANTS[variant][1],
    }
    if variant != "gpt_oss":
        return "gpt_provider.GPTModelProvider", fields
    from megatron.core.activations import quick_gelu

    fields |= {"activation_func": quick_gelu, "position_embedding_type": "yarn", **YARN}
    return "gpt_oss.gpt_oss_provider.GPTOSSProvider", fields


def write_worker(
    rank: int,
    port: int,
    out_dir: Path,
    tp: int,
    ep: int,
    etp: int,
    ckpt_format: str,
    distributed: bool,
    options: dict[str, Any],
) -> None:
    bridge = options.get("bridge")
    if bridge is not None:
        from megatron_bridge_save import import_bridge

        import_bridge(bridge[0], bridge[1:])
    cpu_patches()
    with expert_parallel(rank, port, tp, ep, etp):
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        # Megatron-LM's legacy save: ranks of expert-DP rank 0 write model_optim_rng.pt.
        saves = parallel_state.get_expert_data_parallel_rank() == 0
        dp = world_size(tp, ep, etp) // tp
        grouped, bf16 = options["grouped"], options["bf16"]
        for variant in options["variants"]:
            from megatron.core.transformer.module import Float16Module

            torch.manual_seed(MODEL_SEED)  # the same full model on every rank
            model = build(variant, tp, ep, etp, grouped=grouped, bf16=bf16)
            randomise_norms(model, seed_per_name=True)
            module = Float16Module(model.config, model) if bf16 else model
            ddp, optimizer, scheduler = wrap_for_training(
                model.config, module, global_batch=BATCH * dp, distributed=distributed, bf16=bf16
            )
            # One step of Adam on this DP rank's batch, so the state is real. In eval mode: dropout
            # is off anyway, and megatron-core refuses to *train* experts under TP without
            # sequence parallelism, which its CPU (torch) norms cannot do.
            model.eval()
            generator = torch.Generator().manual_seed(TRAIN_SEED + dist.get_rank() // tp)
            tokens = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ + 1), generator=generator)
            train_step(ddp, optimizer, scheduler, [lm_batch(tokens)], global_batch=BATCH * dp)
            root = out_dir / variant
            args = megatron_args(variant, tp, ep, etp, grouped, bf16)
            args.use_distributed_optimizer = distributed
            if bridge is not None:
                from megatron_bridge_save import save_with_bridge

                provider, fields = bridge_provider(variant, tp, ep, etp)
                form = "dp_reshardable" if distributed else None
                save_with_bridge(root, provider, fields, ddp, optimizer, scheduler, ITERATION, form)
            elif ckpt_format == "torch_dist":
                args.ckpt_format = "torch_dist"
                save_torch_dist(root, model, optimizer, scheduler, args)
            else:
                shard = root / f"iter_{ITERATION:07d}" / rank_dir(tp_rank, ep_rank, ep)
                shard.mkdir(parents=True, exist_ok=True)
                state = {
                    "args": args,
                    "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint(),
                    "optimizer": optimizer.state_dict(),
                    "opt_param_scheduler": scheduler.state_dict(),
                }
                if distributed:  # collective: every rank takes part, DP rank 0s write
                    optimizer.save_parameter_state(str(shard / "distrib_optim.pt"))
                    truth = live_state(optimizer, model)
                    torch.save(truth, root / f"truth_{rank_dir(tp_rank, ep_rank, ep)}.pt")
                if saves:
                    torch.save(state, shard / "model_optim_rng.pt")
            logits = logits_of(model)
            if rank == 0:
                reference = {"input_ids": reference_input_ids(BATCH, SEQ), "logits": logits}
                torch.save(reference, root / "reference.pt")
                (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
            dist.barrier()


def forward_worker(
    rank: int,
    port: int,
    ckpt: Path,
    out: Path,
    tp: int,
    ep: int,
    etp: int,
    variant: str,
    options: dict[str, Any],
) -> None:
    cpu_patches()
    with expert_parallel(rank, port, tp, ep, etp):
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        model = build(variant, tp, ep, etp, options["grouped"], options["bf16"])
        checkpoint_dir = ckpt / f"iter_{ITERATION:07d}"
        if (checkpoint_dir / "metadata.json").exists():
            # torch_dist: megatron-core's own load of the model's sharded state dict; every key
            # the model asks for must be in the checkpoint ("unexpected" in its words).
            from megatron.core import dist_checkpointing

            state, _, unexpected = dist_checkpointing.load(
                {"model": model.sharded_state_dict()}, str(checkpoint_dir), strict="return_all"
            )
            assert not unexpected, sorted(map(str, unexpected))
            model.load_state_dict(state["model"], strict=True)
        else:
            shard = checkpoint_dir / rank_dir(tp_rank, ep_rank, ep)
            state = torch.load(shard / "model_optim_rng.pt", weights_only=False)
            model.load_state_dict(state["model"], strict=True)
            ours = [k for k in state["model"] if not k.endswith("_extra_state")]
            theirs = [k for k in model.state_dict() if not k.endswith("_extra_state")]
            assert ours == theirs, (ours, theirs)
        model.eval()
        logits = logits_of(model)
        if rank == 0:
            torch.save(logits, out)
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    write = sub.add_parser("write")
    write.add_argument("out_dir", type=Path)
    write.add_argument("--format", choices=("legacy", "torch_dist"), default="legacy")
    write.add_argument("--distributed-optimizer", action="store_true")
    write.add_argument("--bridge", type=Path, help="Megatron-Bridge's site: save with it")
    write.add_argument("--bridge-deps", default="", help="omegaconf's sites, comma-separated")
    forward = sub.add_parser("forward")
    forward.add_argument("ckpt", type=Path)
    forward.add_argument("out", type=Path)
    forward.add_argument("--variant", choices=tuple(VARIANTS), required=True)
    write.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    for mode in (write, forward):
        mode.add_argument("--tp", type=int, default=1)
        mode.add_argument("--ep", type=int, default=1)
        mode.add_argument("--etp", type=int, help="Expert tensor parallelism (default: --tp).")
        mode.add_argument("--grouped", action="store_true", help="GroupedMLP experts (bf16).")
        mode.add_argument("--bf16", action="store_true", help="A bf16 model.")
    args = parser.parse_args(argv)
    etp = getattr(args, "etp", None) or args.tp
    # GroupedMLP trains only in bf16; forwards run in fp32 unless --bf16.
    options = {
        "grouped": args.grouped,
        "bf16": args.bf16 or (args.grouped and args.mode == "write"),
        "variants": getattr(args, "variants", None),
    }
    if getattr(args, "bridge", None) is not None:
        options["bridge"] = [args.bridge, *(Path(d) for d in args.bridge_deps.split(",") if d)]
    world = world_size(args.tp, args.ep, etp)
    if args.mode == "write":
        args.out_dir.mkdir(parents=True, exist_ok=True)
        spawn(
            write_worker,
            world,
            args.out_dir.resolve(),
            args.tp,
            args.ep,
            etp,
            args.format,
            args.distributed_optimizer,
            options,
        )
    else:
        spawn(
            forward_worker,
            world,
            args.ckpt.resolve(),
            args.out.resolve(),
            args.tp,
            args.ep,
            etp,
            args.variant,
            options,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
