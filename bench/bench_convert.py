"""Throughput and peak memory of ``ckptctl consolidate`` / ``reshard`` against this machine's `cp`.

Generates a Megatron checkpoint with optimizer state (default ~2.2 GB, TP2 PP2), then, in one
run, times: ``cp -r`` of the same bytes (the machine's copy speed), ckptctl consolidate (HF and
Megatron TP1), ckptctl reshard (TP2 PP2 -> TP1 PP4 and -> TP4 PP1, under
``--memory-budget``), and a naive in-RAM merge (``torch.load`` every shard, concatenate,
``torch.save``: what converters that load the whole model do). Prints a markdown table:
seconds, GB/s, ratio to `cp`, peak RSS.

    python bench/bench_convert.py [--workdir /tmp/ckptctl-bench] [--hidden 2048] [--budget 512MiB]
        [--repeat 3] [--keep] [--cold | --cold-source]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from benchlib import add_cold_options, cache_for, du, measure, print_table

HERE = Path(__file__).resolve().parent


NAIVE = r"""
import sys, glob, torch
src, dst = sys.argv[1], sys.argv[2]
files = sorted(glob.glob(src + "/iter_*/mp_rank_*/model_optim_rng.pt"))
shards = [torch.load(f, weights_only=False) for f in files]   # the whole model in RAM
merged = {}
for s in shards:
    for k, v in s["model"].items():
        merged.setdefault(k, []).append(v)
out = {k: torch.cat(v) if v[0].dim() else v[0] for k, v in merged.items()}
torch.save({"model": out, "optimizer": [s.get("optimizer") for s in shards]}, dst)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--budget", default="512MiB")
    parser.add_argument("--keep", action="store_true", help="Keep the generated checkpoint.")
    parser.add_argument("--repeat", type=int, default=3, help="Runs per command (best is kept).")
    add_cold_options(parser)
    args = parser.parse_args()
    work = args.workdir
    src = work / "src"
    if not src.exists():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                str(HERE.parent / "examples/make_checkpoint.py"),
                "--out",
                str(src),
                "--tp",
                "2",
                "--pp",
                "2",
                "--hidden",
                str(args.hidden),
                "--heads",
                "16",
                "--kv-heads",
                "4",
                "--ffn",
                str(args.hidden),
            ],
            check=True,
        )
    size = du(src)
    ckptctl = [sys.executable, "-m", "ckptctl"]
    runs = [
        ("cp -r (machine copy speed)", ["cp", "-r", str(src), str(work / "copy")], work / "copy"),
        (
            "ckptctl consolidate --format hf",
            [*ckptctl, "consolidate", str(src), str(work / "hf"), "--json"],
            work / "hf",
        ),
        (
            "ckptctl consolidate --format megatron",
            [
                *ckptctl,
                "consolidate",
                str(src),
                str(work / "full"),
                "--format",
                "megatron",
                "--json",
            ],
            work / "full",
        ),
        *(
            (
                f"ckptctl reshard -> TP{tp} PP{pp} (--memory-budget {args.budget})",
                [
                    *ckptctl,
                    "reshard",
                    str(src),
                    str(work / f"tp{tp}pp{pp}"),
                    "--tp",
                    str(tp),
                    "--pp",
                    str(pp),
                    "--memory-budget",
                    args.budget,
                    "--json",
                ],
                work / f"tp{tp}pp{pp}",
            )
            # pipeline stages regrouped; and issue 17's own job: every tensor-parallel shard
            # split in two (row-parallel ones column-wise: half of every row)
            for tp, pp in ((1, 4), (4, 1))
        ),
        (
            "naive torch.load + cat + torch.save",
            [sys.executable, "-c", NAIVE, str(src), str(work / "naive.pt")],
            work / "naive.pt",
        ),
    ]
    cold, cache = cache_for(args, src)
    rows = measure(runs, size, args.repeat, cold=cold)
    print_table(
        rows,
        f"{size / 1e9:.2f} GB Megatron TP2 PP2 with Adam state; {cache}",
        "'seconds': the whole process until its output is on disk (Python start-up and a final "
        "sync included; ckptctl imports no torch for these jobs, the naive merge does); 'of "
        "which converting': ckptctl's own --json figure.",
    )
    if not args.keep:
        shutil.rmtree(src)


if __name__ == "__main__":
    main()
