"""Write a tiny Megatron *legacy* checkpoint with megatron-core's own code.

Test oracle for ``ckptctl``: a real third-party writer rather than a checkpoint
we fabricate ourselves. It spawns ``--tp`` CPU processes (gloo backend),
initialises megatron-core's model-parallel state, builds megatron-core's own
``GPTModel`` (local layer spec, no TransformerEngine) configured Llama-style
(RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings, fp32) and writes::

    OUT_DIR/latest_checkpointed_iteration.txt              "1"
    OUT_DIR/iter_0000001/mp_rank_{tp_rank:02d}/model_optim_rng.pt
    OUT_DIR/reference.pt                                   {"input_ids", "logits"}

Each ``model_optim_rng.pt`` is ``{"args", "checkpoint_version": 3.0,
"iteration": 1, "model": model.state_dict_for_save_checkpoint()}``, as
Megatron-LM's legacy ``save_checkpoint`` lays it out (no optimizer / RNG state).
``reference.pt`` holds megatron-core's own tensor-parallel forward on a fixed
batch: logits in ``[batch, seq, vocab]`` order, fp32, trimmed to the true vocab.

Usage::

    python tests/oracles/megatron_core_legacy_writer.py OUT_DIR [--tp 2]

Needs ``megatron-core==0.16.1`` and ``einops`` on a CPU-only torch, and ``mcore_cpu.py`` next to
this script (the model, CPU patches and rank set-up shared by the megatron-core oracles).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_cpu import (
    CHECKPOINT_VERSION,
    ITERATION,
    MAX_POSITIONS,
    MODEL_SEED,
    NUM_QUERY_GROUPS,
    TRUE_VOCAB,
    causal_mask,
    describe,
    gpt_model,
    model_args,
    model_parallel,
    patch_megatron_for_cpu,
    position_ids,
    randomise_norms,
    reference_input_ids,
    spawn,
    transformer_config,
)

NUM_LAYERS = 2
BATCH, SEQ = 2, 17


def megatron_args(tp: int) -> argparse.Namespace:
    """The ``args`` Namespace Megatron-LM stores in a legacy checkpoint."""
    return argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **model_args(tp, NUM_LAYERS),
        num_experts=None,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        use_distributed_optimizer=False,
        seq_length=MAX_POSITIONS,
    )


def worker(rank: int, port: int, tp: int, out_dir: Path) -> None:
    """One TP rank: build, save its shard and (rank 0) the reference logits."""
    # A forward alone: no optimizer, schedule or dist_checkpointing, so neither CpuAsCudaMode
    # nor the torch.cuda.synchronize no-op.
    patch_megatron_for_cpu(noop_cuda_synchronize=False)
    with model_parallel(rank, port, tp, tp=tp, cpu_as_cuda=False):
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()

        # Every rank starts from the same seed (see gpt_model): the full model is then the same
        # for every --tp.
        torch.manual_seed(MODEL_SEED)
        model = gpt_model(
            transformer_config(tp=tp, num_layers=NUM_LAYERS),
            parallel_output=False,  # gather the vocab-parallel logits on every rank
        )
        randomise_norms(model, seed_per_name=False)
        model.eval()

        state = model.state_dict_for_save_checkpoint()
        for name, value in state.items():
            print(f"[rank {tp_rank}] {name}: {describe(value)}", flush=True)

        shard_dir = out_dir / f"iter_{ITERATION:07d}" / f"mp_rank_{tp_rank:02d}"
        shard_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = {
            "args": megatron_args(tp),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": ITERATION,
            "model": state,
        }
        torch.save(checkpoint, shard_dir / "model_optim_rng.pt")

        input_ids = reference_input_ids(BATCH, SEQ)
        with torch.no_grad():
            # [b, s, padded_v]
            logits = model(input_ids, position_ids(BATCH, SEQ), causal_mask(SEQ))

        if tp_rank == 0:
            reference = {
                "input_ids": input_ids,
                "logits": logits[..., :TRUE_VOCAB].float().contiguous(),
            }
            torch.save(reference, out_dir / "reference.pt")
            (out_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and spawn one process per tensor-parallel rank."""
    parser = argparse.ArgumentParser(description="Write a tiny megatron-core legacy checkpoint.")
    parser.add_argument("out_dir", type=Path, help="checkpoint directory to (over)write")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    args = parser.parse_args(argv)
    if args.tp < 1 or NUM_QUERY_GROUPS % args.tp:
        parser.error(f"--tp must divide num_query_groups={NUM_QUERY_GROUPS}")
    out_dir: Path = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn(worker, args.tp, args.tp, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
