"""Saving from a training loop: how long each saver holds training, and how long until the
checkpoint is complete, in one run on this machine.

A transformers Llama sharded with FSDP2 over ``--ranks`` CPU processes (gloo) with AdamW state
saves ``--saves`` times with each of: ``ckptctl.async_save``, torch's ``dcp.async_save``,
``dcp.save`` and a plain ``torch.save`` of each rank's state dict (the synchronous baseline).
Prints a markdown table: checkpoint size, median seconds training was blocked per save, median
seconds until the checkpoint was complete, training-step time while a background save runs
against without, and the peak RSS of the largest rank.

    python bench/bench_training.py [--workdir /tmp/ckptctl-bench-training] [--hidden 1024]
        [--layers 8] [--vocab 32000] [--ranks 2] [--saves 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchlib import compile_bytecode, du, remove

HERE = Path(__file__).resolve().parent
SAVERS = ("torch_save", "dcp_save", "dcp_async", "ckptctl_async")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-training"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    compile_bytecode()
    remove(args.workdir)
    args.workdir.mkdir(parents=True)
    rows = []
    for saver in SAVERS:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(args.ranks), str(HERE / "training_job.py"),
            str(args.workdir), saver,
            *map(str, (args.hidden, args.layers, args.vocab, args.saves)),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"{saver} failed:\n{done.stderr[-3000:]}")
        found = json.loads((args.workdir / f"{saver}.json").read_text())
        size = du(args.workdir / f"{saver}_0")
        for n in range(args.saves):
            remove(args.workdir / f"{saver}_{n}")
        rows.append((saver, size, found))
    print(
        f"\nFSDP2 Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, "
        f"{args.ranks} CPU ranks (gloo), AdamW; median of {args.saves} saves\n"
    )
    print("| saver | checkpoint GB | training blocked s | until complete s | "
          "step s (during save / alone) | peak RSS per rank |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    base = statistics.median(rows[0][2]["blocked"])
    for saver, size, found in rows:
        blocked = statistics.median(found["blocked"])
        complete = statistics.median(found["complete"])
        alone = statistics.median(found["step"])
        during = found["step_during_save"]
        step = f"{statistics.median(during):.2f} / {alone:.2f}" if during else f"- / {alone:.2f}"
        print(
            f"| {saver} | {size / 1e9:.2f} | {blocked:.3f} ({blocked / base:.2f}x torch.save) | "
            f"{complete:.2f} | {step} | {max(found['rss']) / 2**20:.0f} MiB |"
        )
    print(
        "\n'until complete' for the asynchronous savers includes one training step run while "
        "the save was written in the background."
    )


if __name__ == "__main__":
    main()
