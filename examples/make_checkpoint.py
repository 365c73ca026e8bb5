"""Write a tiny (or not so tiny) HF Llama as a Megatron-LM legacy checkpoint.

Builds a random Llama with ``ckptctl.synth`` (plain torch + transformers, no other ckptctl code),
takes one Adam step so the optimizer moments are non-trivial, and writes the weights after the
step as ``OUT/iter_0000001/mp_rank_TT[_PPP]/model_optim_rng.pt`` for any TP / PP / VPP layout
(plus ``distrib_optim.pt`` beside each with ``--distributed-optimizer``).

Examples::

    python examples/make_checkpoint.py --out /tmp/ckpt --tp 2 --pp 2 --hf-out /tmp/hf
    python examples/make_checkpoint.py --out /tmp/ckpt --tp 1 --pp 4 --vpp 2 --tied
    python examples/make_checkpoint.py --out /tmp/ckpt --tp 2 --pp 2 --distributed-optimizer \
        --dp 2 --bucket-size 5000                      # + distrib_optim.pt per (tp, pp)
    python examples/make_checkpoint.py --out /tmp/big --tp 2 --pp 2 --hidden 2048 --heads 16 \\
        --kv-heads 4 --ffn 5632 --vocab 32000          # several GB
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# Run from a checkout without installing: make `ckptctl` importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckptctl import synth


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Megatron checkpoint directory to write")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per stage")
    parser.add_argument("--first-stage-layers", type=int, default=None)
    parser.add_argument("--last-stage-layers", type=int, default=None)
    parser.add_argument("--tied", action="store_true", help="tie embeddings and output layer")
    parser.add_argument("--naming", choices=("te", "local"), default="te")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128, help="intermediate (ffn hidden) size")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=None, help="default hidden // heads")
    parser.add_argument("--vocab", type=int, default=1100, help="true (unpadded) vocab size")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--iteration", type=int, default=1)
    parser.add_argument("--no-optimizer", action="store_true", help="omit optimizer state")
    parser.add_argument(
        "--param-group-order",
        choices=("appearance", "wd_first"),
        default="appearance",
        help="optimizer param-group order: first appearance (megatron-core <= 0.15) or the "
        "weight-decay group first (megatron-core 0.16); differs only for --naming local, pp > 1",
    )
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="write Megatron's distributed-optimizer state: param groups in model_optim_rng.pt, "
        "fp32 master weights and Adam moments in distrib_optim.pt (coalesced, core >= 0.8)",
    )
    parser.add_argument(
        "--dp", type=int, default=1, help="data-parallel size (args; distributed-optimizer padding)"
    )
    parser.add_argument(
        "--bucket-size",
        type=int,
        default=None,
        help="--ddp-bucket-size with --overlap-grad-reduce (default: off, one bucket); only "
        "pipeline stage 0's first model chunk is bucketed, as in megatron-core",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-out", default=None, help="also save the HF model (after the step)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    start = time.perf_counter()
    config = synth.tiny_llama_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.ffn,
        head_dim=args.head_dim,
        tie_word_embeddings=args.tied,
    )
    model = synth.make_model(config, seed=args.seed)
    states = synth.adam_step(model, seed=args.seed)
    try:
        synth.write_megatron(
            model,
            states,
            args.out,
            tp=args.tp,
            pp=args.pp,
            vpp=args.vpp,
            first_stage_layers=args.first_stage_layers,
            last_stage_layers=args.last_stage_layers,
            naming=args.naming,
            params_dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
            iteration=args.iteration,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            with_optimizer=not args.no_optimizer,
            param_group_order=args.param_group_order,
            distributed_optimizer=args.distributed_optimizer,
            dp=args.dp,
            bucket_size=args.bucket_size,
        )
    except ValueError as exc:  # an impossible layout: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.hf_out:
        synth.save_hf(model, args.hf_out)
    n_params = sum(p.numel() for p in model.parameters())
    elapsed = time.perf_counter() - start
    print(
        f"wrote {args.out} (tp={args.tp} pp={args.pp} vpp={args.vpp} dp={args.dp}"
        f"{', distributed optimizer' if args.distributed_optimizer else ''},"
        f" {n_params:,} parameters)"
        f" in {elapsed:.1f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
