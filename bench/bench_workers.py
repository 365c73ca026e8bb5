"""Scale-out on one machine: the same reshard as 1, 2 and 4 processes (``--workers``), against
``cp -r`` of the same bytes, with the cost model's prediction for as many nodes.

Uses the checkpoint of ``bench_convert.py`` (generated if missing: 2.28 GB Megatron TP2 PP2 with
Adam state) and reshards it to TP1 PP4 (four rank files, so up to four processes have work).
Prints a markdown table: seconds (whole run until the output is on disk), ratio to ``cp``,
speed-up over one process, summed peak RSS of the processes, and the cost model's time on one
machine (storage shared) and on as many nodes each with its own disk and NIC.

    python bench/bench_workers.py [--workdir /tmp/ckptctl-bench] [--repeat 2] [--workers 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchlib import Timing, attempt, compile_bytecode, du, remove

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench"))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    src, out, copy = args.workdir / "src", args.workdir / "workers-out", args.workdir / "copy"
    if not src.exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, str(HERE.parent / "examples/make_checkpoint.py"), "--out", str(src),
             "--tp", "2", "--pp", "2", "--hidden", "2048", "--heads", "16", "--kv-heads", "4",
             "--ffn", "2048"],
            check=True,
        )  # fmt: skip
    compile_bytecode()
    size = du(src)
    subprocess.run(["cat", *map(str, src.rglob("*.pt"))], stdout=subprocess.DEVNULL, check=True)
    ckptctl = [sys.executable, "-m", "ckptctl"]
    target = ["--tp", "1", "--pp", "4"]

    def best(cmd: list[str], where: Path) -> Timing:
        runs = []
        for _ in range(args.repeat):
            runs.append(attempt(cmd, where))
        remove(where)
        return min(runs)

    cp_seconds, *_ = best(["cp", "-r", str(src), str(copy)], copy)
    print(f"\nsource: {size / 1e9:.2f} GB Megatron TP2 PP2 with Adam state -> TP1 PP4; page cache "
          f"warm; best of {args.repeat}; times include a final sync\n")  # fmt: skip
    print("| run | seconds | vs cp | speed-up | peak RSS (largest process) | model: one machine | "
          "model: a node each |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| cp -r | {cp_seconds:.2f} | 1.00x | - | - | - | - |")
    one = None
    for workers in (int(w) for w in args.workers.split(",")):
        plan = json.loads(
            subprocess.run(
                [*ckptctl, "plan", str(src), str(out), *target, "--workers", str(max(workers, 2)),
                 "--json"],
                capture_output=True, text=True, check=True,
            ).stdout
        )  # fmt: skip
        model = plan["workers"]
        cmd = [*ckptctl, "reshard", str(src), str(out), *target, "--json"]
        if workers > 1:
            cmd += ["--workers", str(workers)]
        seconds, rss, *_ = best(cmd, out)
        one = one or seconds
        machine = model["seconds_one_machine"] if workers > 1 else model["seconds_one_process"]
        nodes = model["seconds_one_node_each"] if workers > 1 else model["seconds_one_process"]
        print(
            f"| ckptctl reshard, {workers} process{'es' if workers > 1 else ''} | {seconds:.2f} | "
            f"{cp_seconds / seconds:.2f}x | {one / seconds:.2f}x | {rss / 2**20:.0f} MiB | "
            f"{machine:.2f} s | {nodes:.2f} s |"
        )
    print(
        "\npeak RSS: GNU time's figure, the largest of the launching process and its ranks. "
        "The model's times are the storage profile's: on one machine processes share the disk; "
        "a node each divides the bytes."
    )


if __name__ == "__main__":
    main()
