"""A dense-first mixture-of-experts model (DeepSeek's shape: a dense layer, then MoE layers)
under pipeline and expert parallelism, saved and loaded with its optimizer state by
megatron-core's own code, as Megatron-LM's legacy checkpoint keeps it (test oracle, issue 54).

megatron-core chains a dense and an expert optimizer only on ranks that hold expert
parameters: with the dense layer alone on the first pipeline stage
(``num_layers_in_first_pipeline_stage=1``, ``moe_layer_freq=[0, 1, 1]``) that stage has the
dense optimizer alone, and its ``ChainedOptimizer`` saves it unchained (a dict, and one
``distrib_optim.pt`` from its DP rank 0), while the MoE stage saves the list of both.

Modes, on 4 CPU ranks with gloo (PP 2, EP 2, DP 2, TP 1), megatron-core 0.16.1, local layer
spec:

``write OUT [--distributed-optimizer]``
    Builds the model, trains it one Adam step through megatron-core's pipeline schedule and
    saves each rank's ``model_optim_rng.pt`` (``args``, model, ``optimizer.state_dict()``,
    scheduler) into ``mp_rank_00_PPP_EEE`` and, with the distributed optimizer,
    ``optimizer.save_parameter_state`` (collective; DP rank 0s write) to ``distrib_optim.pt``.
    Each rank's optimizer as megatron-core holds it goes to ``OUT/truth_<rank dir>.pt``.

``load CKPT OUT``
    Builds the same model and optimizer, loads a legacy checkpoint of that layout as
    Megatron-LM's ``load_checkpoint`` does (``model.load_state_dict(strict=True)``,
    ``optimizer.load_state_dict``, ``optimizer.load_parameter_state``) and writes what the
    optimizer then holds to ``OUT/truth_<rank dir>.pt``, for the test to compare.

What an optimizer "holds": per parameter (by name) its fp32 master and Adam moments (the
distributed optimizer's, gathered over its DP group: ``megatron_core_moe.live_state``; else the
torch state) and each sub-optimizer's parameter groups (step, lr, weight decay, ...).
"""

from __future__ import annotations

import argparse
import sys
from inspect import signature
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_cpu import (
    CHECKPOINT_VERSION,
    ITERATION,
    MAX_POSITIONS,
    MODEL_SEED,
    ROTARY_BASE,
    TRUE_VOCAB,
    lm_batch,
    model_parallel,
    padded_vocab_size,
    randomise_norms,
    spawn,
    train_step,
    transformer_config,
    wrap_for_training,
)
from megatron_core_moe import (
    BATCH,
    SEQ,
    TRAIN_SEED,
    cpu_patches,
    live_state,
    megatron_args,
    moe_fields,
)

PP, EP, TP, DP = 2, 2, 1, 2
NUM_LAYERS = 3
MOE_LAYER_FREQ = [0, 1, 1]
FIRST_STAGE_LAYERS = 1


def rank_dir(pp_rank: int, ep_rank: int) -> str:
    return f"mp_rank_00_{pp_rank:03d}_{ep_rank:03d}"


def build() -> tuple[torch.nn.Module, Any]:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = transformer_config(
        tp=TP,
        num_layers=NUM_LAYERS,
        pp=PP,
        pipeline_dtype=torch.float32,
        **moe_fields(TP, EP),
        expert_tensor_parallel_size=TP,
        moe_layer_freq=MOE_LAYER_FREQ,
        num_layers_in_first_pipeline_stage=FIRST_STAGE_LAYERS,
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    # Releases before 0.16 find the stage themselves (no ``pp_rank``).
    where = (
        {"pp_rank": pp_rank}
        if "pp_rank" in signature(get_gpt_decoder_block_spec).parameters
        else {}
    )
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm", **where
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(TP),
        max_sequence_length=MAX_POSITIONS,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        position_embedding_type="rope",
        rotary_base=ROTARY_BASE,
    )
    offset = model.decoder.layers[0].layer_number - 1
    randomise_norms(model, seed_per_name=True, layer_offset=offset)
    return model, config


def args_of(distributed: bool) -> argparse.Namespace:
    """Megatron-LM's ``args`` for this run (``megatron_core_moe``'s, with the pipeline)."""
    args = megatron_args("mixtral", TP, EP, TP)
    args.num_layers = NUM_LAYERS
    args.pipeline_model_parallel_size = PP
    args.world_size = PP * TP * DP
    args.data_parallel_size = DP
    args.moe_layer_freq = MOE_LAYER_FREQ
    args.decoder_first_pipeline_num_layers = FIRST_STAGE_LAYERS
    args.use_distributed_optimizer = distributed
    return args


def held(optimizer: Any, model: torch.nn.Module, distributed: bool) -> dict[str, Any]:
    """What the optimizer holds (see the module's docstring)."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    groups = [
        [{k: v for k, v in g.items() if k != "params"} for g in sub.optimizer.param_groups]
        for sub in subs
    ]
    if distributed:
        tensors = live_state(optimizer, model)
    else:
        tensors = {}
        for name, param in model.named_parameters():
            sub = next(
                s for s in subs if any(param is p for g in s.param_groups for p in g["params"])
            )
            state = sub.optimizer.state[param]
            tensors[name] = {"param": param.detach().clone(), **state}
    return {"sub_optimizers": len(subs), "groups": groups, "tensors": tensors}


def worker(rank: int, port: int, mode: str, ckpt: Path, out: Path, distributed: bool) -> None:
    cpu_patches()
    with model_parallel(
        rank, port, PP * TP * DP, tp=TP, pp=PP, cpu_as_cuda=True, expert_model_parallel_size=EP
    ):
        from megatron.core import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        torch.manual_seed(MODEL_SEED)
        model, config = build()
        ddp, optimizer, scheduler = wrap_for_training(
            config, model, global_batch=BATCH * DP, distributed=distributed
        )
        shard = ckpt / f"iter_{ITERATION:07d}" / rank_dir(pp_rank, ep_rank)
        if mode == "write":
            # In eval mode: dropout is off anyway (see megatron_core_moe's write_worker).
            model.eval()
            dp_rank = parallel_state.get_data_parallel_rank()
            generator = torch.Generator().manual_seed(TRAIN_SEED + dp_rank)
            tokens = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ + 1), generator=generator)
            train_step(ddp, optimizer, scheduler, [lm_batch(tokens)], global_batch=BATCH * DP)
            shard.mkdir(parents=True, exist_ok=True)
            if distributed:  # collective: every rank takes part, DP rank 0s write
                optimizer.save_parameter_state(str(shard / "distrib_optim.pt"))
            if parallel_state.get_expert_data_parallel_rank() == 0:
                state = {
                    "args": args_of(distributed),
                    "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint(),
                    "optimizer": optimizer.state_dict(),
                    "opt_param_scheduler": scheduler.state_dict(),
                }
                torch.save(state, shard / "model_optim_rng.pt")
            if rank == 0:
                (ckpt / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        else:
            state = torch.load(shard / "model_optim_rng.pt", weights_only=False)
            model.load_state_dict(state["model"], strict=True)
            optimizer.load_state_dict(state["optimizer"])
            if distributed:
                optimizer.load_parameter_state(str(shard / "distrib_optim.pt"))
        truth = held(optimizer, model, distributed)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(truth, out / f"truth_{rank_dir(pp_rank, ep_rank)}.pt")
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    write = sub.add_parser("write")
    write.add_argument("ckpt", type=Path)
    load = sub.add_parser("load")
    load.add_argument("ckpt", type=Path)
    load.add_argument("out", type=Path)
    for mode in (write, load):
        mode.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args(argv)
    ckpt = args.ckpt.resolve()
    out = args.out.resolve() if args.mode == "load" else ckpt
    spawn(worker, PP * TP * DP, args.mode, ckpt, out, args.distributed_optimizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
