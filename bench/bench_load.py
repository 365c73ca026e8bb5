"""Loading a sharded checkpoint in a training job: ``ckptctl.load`` against torch's own
``dcp.load``, on the number of ranks that saved it and on another, in one run.

Every rank holds a row shard of ``--tensors`` float32 tensors; ``--save-ranks`` ranks save them
with ``ckptctl.save`` (DCP's layout, which both loaders read); then each loader fills every
``--load-ranks`` layout's shards, the two loaders interleaved, page cache warm (or emptied,
``--cold``), timed between two barriers of the ranks (process start-up excluded). Each rank
checks its values. Prints a markdown table: the median seconds, the checkpoint's GB/s, the
bytes ckptctl's ranks read for the CRC-32 checks of records they read in parts, and the
largest rank's peak RSS.

    python bench/bench_load.py [--workdir /tmp/ckptctl-bench-load] [--rows 6144]
        [--cols 8192] [--tensors 8] [--save-ranks 2] [--load-ranks 2 4] [--repeat 3]
        [--cold | --cold-source]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchlib import add_cold_options, cold_of, compile_bytecode, du, read_all, remove

HERE = Path(__file__).resolve().parent
LOADERS = ("ckptctl", "torch")


def torchrun(ranks: int, *args: object) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(ranks), str(HERE / "load_job.py"), *map(str, args),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{' '.join(map(str, args[:1]))} on {ranks} ranks failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-load"))
    parser.add_argument("--rows", type=int, default=6144)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--save-ranks", type=int, default=2)
    parser.add_argument("--load-ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    add_cold_options(parser)
    args = parser.parse_args()
    compile_bytecode()
    work = args.workdir
    shape = (args.rows, args.cols, args.tensors)
    remove(work)
    work.mkdir(parents=True)
    torchrun(args.save_ranks, "save", work, *shape)
    ckpt = work / "ckpt"
    cold = cold_of(args, ckpt)
    size = du(ckpt)
    seconds: dict[tuple[int, str], list[float]] = {}
    last: dict[tuple[int, str], dict] = {}
    for _ in range(args.repeat):
        for ranks in args.load_ranks:
            for how in LOADERS:
                if cold:
                    cold.start()
                else:
                    read_all(ckpt)
                torchrun(ranks, "load", work, *shape, how)
                found = json.loads((work / "load.json").read_text())
                seconds.setdefault((ranks, how), []).append(found["seconds"])
                last[(ranks, how)] = found
    cache = cold.describe() if cold else "warm"
    print(
        f"\n{size / 1e9:.2f} GB: {args.tensors} float32 tensors of {args.rows} x {args.cols} "
        f"saved by {args.save_ranks} ranks (ckptctl.save); page cache {cache}; median of "
        f"{args.repeat}, loaders interleaved\n"
    )
    print("| load ranks | loader | strategy | seconds | GB/s | read for checks | peak RSS |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for (ranks, how), times in seconds.items():
        found = last[(ranks, how)]["ranks"]
        median = statistics.median(times)
        strategy = found[0].get("strategy", "dcp.load")
        checks = sum(r.get("read_for_record_checks", {}).get("bytes", 0) for r in found)
        checked = f"{checks / 1e6:.1f} MB" if how == "ckptctl" else "-"
        rss = max(r["rss"] for r in found) / 2**20
        print(
            f"| {ranks} | {how} | {strategy} | {median:.2f} | {size / median / 1e9:.2f} | "
            f"{checked} | {rss:.0f} MiB |"
        )
    remove(work)


if __name__ == "__main__":
    main()
