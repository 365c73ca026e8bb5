"""Write a tiny Megatron legacy checkpoint *with distributed-optimizer state*, using megatron-core.

Test oracle for ``ckptctl``: a real third-party writer of ``distrib_optim.pt``. It spawns
``tp * pp * dp`` CPU processes (gloo backend), initialises megatron-core's model-parallel state,
builds megatron-core's own ``GPTModel`` per pipeline stage (local layer spec, Llama-style:
RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings unless ``--tie-embeddings``), wraps it
in megatron-core's ``DistributedDataParallel`` and ``DistributedOptimizer`` (through
``get_megatron_optimizer``), runs ONE training step through megatron-core's pipeline schedule
(``get_forward_backward_func``, 1F1B when ``--pp`` > 1) and ``optimizer.step()``, then saves the
way Megatron-LM's legacy ``save_checkpoint`` (``--ckpt-format torch``) does::

    OUT_DIR/latest_checkpointed_iteration.txt                 "1"
    OUT_DIR/iter_0000001/mp_rank_TT[_PPP]/model_optim_rng.pt  DP rank 0 of each (tp, pp)
    OUT_DIR/iter_0000001/mp_rank_TT[_PPP]/distrib_optim.pt    optimizer.save_parameter_state
    OUT_DIR/truth_tp{T}_pp{P}.pt                              ground truth, see below
    OUT_DIR/meta.json                                         buffer / bucket layout megatron used

``model_optim_rng.pt`` = ``{"args", "checkpoint_version": 3.0, "iteration": 1, "model":
GPTModel.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
"opt_param_scheduler": OptimizerParamScheduler.state_dict()}``.

``truth_tp{T}_pp{P}.pt`` = ``{param_name: {"param", "exp_avg", "exp_avg_sq"}}`` for every
parameter of that (tp, pp) rank (names = ``model`` keys, local layer indices): the fp32 master
weight and Adam moments in the parameter's local (TP-shard) shape, read from the live optimizer
after the step. Each DP rank contributes the slice it owns (megatron's own
``_get_model_param_range_map`` / ``_get_main_param_and_optimizer_states``); the slices are summed
over the DP group and checked to cover every element exactly once. A reader of
``distrib_optim.pt`` must reproduce these tensors exactly.

``meta.json`` holds the run settings and, per ``"tp{T}_pp{P}"``, the effective DDP bucket size
(``None``: one bucket) and per grad buffer its ``dtype_key``, ``numel``, ``numel_unpadded``,
``param_order`` (the order megatron registered the parameters in, = ``named_parameters()``; the
buffer is filled in reverse), ``index_in_buffer_order`` (name -> ``[start, end, bucket_id]`` in
the padded buffer) and ``buckets`` (``offset``, padded ``numel``, ``numel_unpadded``, params).

Usage::

    python tests/oracles/megatron_core_distopt_writer.py OUT_DIR [--tp 2 --pp 2 --dp 2]
        [--bucket-size N] [--overlap-grad-reduce] [--bf16] [--tie-embeddings]
        [--hidden 64 --ffn-hidden 128]

With the default sizes every parameter's numel is a multiple of 64, so the buffer has no
alignment gaps; ``--hidden 48 --ffn-hidden 100`` gives RMSNorm weights (48) and ``linear_fc2``
shards that are not, which exercises megatron's 64-element parameter-start alignment.

``--bucket-size`` implies ``--overlap-grad-reduce`` (without it megatron-core ignores the bucket
size and uses one bucket per buffer). Needs ``megatron-core==0.16.1`` and ``einops`` on a CPU-only
torch, and ``mcore_cpu.py`` next to this script (the model, CPU patches, rank set-up and training
step shared by the megatron-core oracles); TP2 PP2 DP2 (8 processes) takes well under a minute on
2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_cpu import (
    CHECKPOINT_VERSION,
    DATA_SEED,
    FFN_HIDDEN,
    HIDDEN,
    ITERATION,
    MODEL_SEED,
    NUM_QUERY_GROUPS,
    TRUE_VOCAB,
    adam_args,
    describe,
    gpt_model,
    lm_batch,
    mean_loss,
    model_args,
    model_parallel,
    patch_megatron_for_cpu,
    randomise_norms,
    spawn,
    train_step,
    transformer_config,
    wrap_for_training,
)

NUM_LAYERS = 4
SEQ = 16
MICRO_BATCH = 2
NUM_MICROBATCHES = 2
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def megatron_args(opts: argparse.Namespace) -> argparse.Namespace:
    """The ``args`` Namespace Megatron-LM stores in a legacy checkpoint (names as Megatron-LM)."""
    dtype = torch.bfloat16 if opts.bf16 else torch.float32
    return argparse.Namespace(
        tensor_model_parallel_size=opts.tp,
        pipeline_model_parallel_size=opts.pp,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_size=opts.dp,
        world_size=opts.tp * opts.pp * opts.dp,
        expert_model_parallel_size=1,
        **model_args(
            opts.tp,
            NUM_LAYERS,
            hidden=opts.hidden,
            ffn_hidden=opts.ffn_hidden,
            tie_embeddings=opts.tie_embeddings,
        ),
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=MICRO_BATCH * NUM_MICROBATCHES * opts.dp,
        num_experts=None,
        params_dtype=dtype,
        bf16=opts.bf16,
        fp16=False,
        accumulate_allreduce_grads_in_fp32=opts.bf16,
        use_distributed_optimizer=True,
        overlap_grad_reduce=opts.overlap_grad_reduce,
        overlap_param_gather=False,
        ddp_bucket_size=opts.bucket_size,
        ckpt_format="torch",
        **adam_args(),
        iteration=ITERATION,
    )


def microbatches(dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's slice of a fixed, seeded global batch, split into micro-batches."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    n_seq = dp * NUM_MICROBATCHES * MICRO_BATCH
    tokens = torch.randint(0, TRUE_VOCAB, (n_seq, SEQ + 1), generator=generator)
    mine = tokens.view(dp, NUM_MICROBATCHES, MICRO_BATCH, SEQ + 1)[dp_rank]
    return [lm_batch(mb) for mb in mine]


# --------------------------------------------------------------------------- truth and layout


def gather_truth(
    dist_opt: Any, named_params: list[tuple[str, torch.nn.Parameter]], dp_group: Any
) -> dict[str, dict[str, torch.Tensor]]:
    """Full local fp32 master param and Adam moments per parameter, assembled over DP.

    Each DP rank fills the elements it owns (megatron's own param range map) and the pieces are
    summed over the DP group; a coverage count proves every element is owned exactly once.
    """
    truth: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in named_params:
        full = {key: torch.zeros(param.numel(), dtype=torch.float32) for key in STATE_KEYS}
        cover = torch.zeros(param.numel(), dtype=torch.int32)
        if param in dist_opt.model_param_gbuf_map:
            piece = dist_opt._get_model_param_range_map(param)["param"]
            tensors = dist_opt._get_main_param_and_optimizer_states(param)
            for key in STATE_KEYS:
                full[key][piece.start : piece.end] = tensors[key].detach().float().view(-1)
            cover[piece.start : piece.end] += 1
        for tensor in (*full.values(), cover):
            dist.all_reduce(tensor, group=dp_group)
        assert bool((cover == 1).all()), f"{name}: DP shards do not cover it exactly once"
        truth[name] = {key: full[key].view(param.shape).clone() for key in STATE_KEYS}
    return truth


def layout_meta(
    ddp: Any, dist_opt: Any, names: dict[torch.nn.Parameter, str]
) -> list[dict[str, Any]]:
    """The buffers and buckets megatron-core built for this (tp, pp) rank."""
    buffers = []
    for buffer in ddp.buffers:
        index = {
            names[p]: list(buffer.param_index_map[p])
            for p in sorted(buffer.params, key=lambda p: buffer.param_index_map[p][0])
        }
        buffers.append(
            {
                "dtype_key": [str(buffer.param_dtype), str(buffer.grad_dtype)],
                "numel": buffer.numel,
                "numel_unpadded": buffer.numel_unpadded,
                "param_order": [names[p] for p in buffer.params],
                "index_in_buffer_order": index,
                "buckets": [
                    {
                        "offset": bucket.offset,
                        "numel": bucket.grad_data.numel(),
                        "numel_unpadded": bucket.numel_unpadded,
                        "params": [names[p] for p in bucket.params_list],
                    }
                    for bucket in buffer.buckets
                ],
            }
        )
    assert [b.numel_unpadded for b in ddp.buffers] == [b.numel_unpadded for b in dist_opt.buffers]
    return buffers


# --------------------------------------------------------------------------- worker


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``mp_rank_TT`` (PP == 1) or ``mp_rank_TT_PPP``, as Megatron-LM's get_checkpoint_name."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def worker(rank: int, port: int, opts: argparse.Namespace, out_dir: Path) -> None:
    """One global rank: build, train one step, save its shard and its part of the truth."""
    patch_megatron_for_cpu(noop_cuda_synchronize=True)
    world = opts.tp * opts.pp * opts.dp
    with model_parallel(rank, port, world, tp=opts.tp, pp=opts.pp, cpu_as_cuda=True):
        run_rank(opts, out_dir)


def run_rank(opts: argparse.Namespace, out_dir: Path) -> None:
    """The body of :func:`worker`, inside :class:`CpuAsCudaMode`."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()

    # Every rank starts from the same seed (see gpt_model).
    torch.manual_seed(MODEL_SEED)
    dtype = torch.bfloat16 if opts.bf16 else torch.float32
    # pipeline_dtype and deallocate_pipeline_outputs as Megatron-LM sets them for training.
    config = transformer_config(
        tp=opts.tp,
        pp=opts.pp,
        num_layers=NUM_LAYERS,
        hidden=opts.hidden,
        ffn_hidden=opts.ffn_hidden,
        dtype=dtype,
        pipeline_dtype=dtype,
        deallocate_pipeline_outputs=True,
    )
    # Megatron-LM's GPT model provider for this pipeline stage (layers split evenly).
    gpt = gpt_model(
        config,
        parallel_output=True,
        tie_embeddings=opts.tie_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    randomise_norms(gpt, seed_per_name=True, layer_offset=pp_rank * (NUM_LAYERS // opts.pp))
    module: torch.nn.Module = Float16Module(config, gpt) if opts.bf16 else gpt

    global_batch = MICRO_BATCH * NUM_MICROBATCHES * opts.dp
    ddp, optimizer, scheduler = wrap_for_training(
        config,
        module,
        global_batch=global_batch,
        bf16=opts.bf16,
        overlap_grad_reduce=opts.overlap_grad_reduce,
        bucket_size=opts.bucket_size,
    )
    losses, grad_norm = train_step(
        ddp, optimizer, scheduler, microbatches(dp_rank, opts.dp), global_batch=global_batch
    )
    if losses:
        loss = mean_loss(losses)
        print(f"[tp{tp_rank} pp{pp_rank} dp{dp_rank}] loss {loss:.4f} grad_norm {grad_norm:.4f}")

    dist_opt = optimizer.chained_optimizers[0]
    names = {param: name for name, param in gpt.named_parameters()}
    state = gpt.state_dict_for_save_checkpoint()
    assert all(name in state for name in names.values())

    rank_dir = out_dir / f"iter_{ITERATION:07d}" / rank_dir_name(tp_rank, pp_rank, opts.pp)
    if dp_rank == 0:
        rank_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # Megatron-LM's save_checkpoint: the DP-gathered parameter state first (collective over DP,
    # written by DP rank 0), then model_optim_rng.pt on DP rank 0.
    optimizer.save_parameter_state(str(rank_dir / "distrib_optim.pt"))
    truth = gather_truth(dist_opt, list(gpt.named_parameters()), dp_group)
    meta = {
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "ddp_bucket_size": ddp.bucket_size,
        "buffers": layout_meta(ddp, dist_opt, names),
    }
    if dp_rank == 0:
        checkpoint = {
            "args": megatron_args(opts),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": ITERATION,
            "model": state,
            "optimizer": optimizer.state_dict(),
            "opt_param_scheduler": scheduler.state_dict(),
        }
        torch.save(checkpoint, rank_dir / "model_optim_rng.pt")
        torch.save(truth, out_dir / f"truth_tp{tp_rank}_pp{pp_rank}.pt")

    metas: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(metas, meta if dp_rank == 0 else None)
    if dist.get_rank() == 0:
        write_meta(out_dir, opts, [m for m in metas if m is not None])
        (out_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        print("distrib_optim.pt:", describe(torch.load(rank_dir / "distrib_optim.pt")))
        saved = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)
        print("model_optim_rng.pt['optimizer']:", describe(saved["optimizer"]))
    dist.barrier()


def write_meta(out_dir: Path, opts: argparse.Namespace, metas: list[dict[str, Any]]) -> None:
    """OUT_DIR/meta.json: run settings plus per-(tp, pp) buffer layout."""
    import megatron.core

    meta = {
        "megatron_core": megatron.core.__version__,
        "torch": torch.__version__,
        "tp": opts.tp,
        "pp": opts.pp,
        "dp": opts.dp,
        "bf16": opts.bf16,
        "tie_embeddings": opts.tie_embeddings,
        "hidden": opts.hidden,
        "ffn_hidden": opts.ffn_hidden,
        "overlap_grad_reduce": opts.overlap_grad_reduce,
        "bucket_size": opts.bucket_size,
        "ranks": {
            f"tp{m['tp_rank']}_pp{m['pp_rank']}": m
            for m in sorted(metas, key=lambda m: (m["tp_rank"], m["pp_rank"]))
        },
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and spawn one process per global rank."""
    parser = argparse.ArgumentParser(
        description="Write a tiny megatron-core legacy checkpoint with distributed optimizer."
    )
    parser.add_argument("out_dir", type=Path, help="checkpoint directory to (over)write")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    parser.add_argument(
        "--bucket-size",
        type=int,
        default=None,
        help="DDP bucket size in elements (implies --overlap-grad-reduce)",
    )
    parser.add_argument("--overlap-grad-reduce", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 params, fp32 main params/grads")
    parser.add_argument("--tie-embeddings", action="store_true", help="share embedding/output")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden size ({HIDDEN})")
    parser.add_argument(
        "--ffn-hidden", type=int, default=FFN_HIDDEN, help=f"FFN hidden size ({FFN_HIDDEN})"
    )
    opts = parser.parse_args(argv)
    if opts.tp < 1 or NUM_QUERY_GROUPS % opts.tp:
        parser.error(f"--tp must divide num_query_groups={NUM_QUERY_GROUPS}")
    if opts.pp < 1 or NUM_LAYERS % opts.pp:
        parser.error(f"--pp must divide num_layers={NUM_LAYERS}")
    if opts.dp < 1:
        parser.error("--dp must be >= 1")
    if opts.ffn_hidden % opts.tp:
        parser.error("--tp must divide --ffn-hidden")
    if opts.bucket_size is not None:
        opts.overlap_grad_reduce = True
    out_dir: Path = opts.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    world = opts.tp * opts.pp * opts.dp
    spawn(worker, world, opts, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
