"""Run one command and print what the disk did meanwhile: read and write GB/s and the mean
request size, sampled from ``/proc/diskstats`` (Linux) every ``--every`` seconds.

What a cold table's figures cannot say: whether a slow run was the job or the disk (on a
virtual machine the host's disk swings several-fold within minutes, for ``cp`` as for
ckptctl). ``--cold SOURCE`` reads the source, then empties the page cache first (root), as the
benches' cold runs do; ``--cold-source SOURCE`` evicts the source's pages alone.

    python bench/disk_trace.py [--device vda] [--every 0.2] [--cold SRC | --cold-source SRC]
        -- cp -r SRC OUT
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import threading
import time
from pathlib import Path

from benchlib import add_cold_path_options, cold_of_paths

SECTOR = 512


def sample(device: str) -> tuple[int, int, int, int]:
    """Reads completed, sectors read, writes completed, sectors written of ``device``."""
    for line in Path("/proc/diskstats").read_text().splitlines():
        fields = line.split()
        if fields[2] == device:
            return int(fields[3]), int(fields[5]), int(fields[7]), int(fields[9])
    raise SystemExit(f"no device {device} in /proc/diskstats (see lsblk; pass --device)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="vda")
    parser.add_argument("--every", type=float, default=0.2)
    add_cold_path_options(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    cold = cold_of_paths(args)
    if cold is not None:
        cold.start()
    samples: list[tuple[float, tuple[int, int, int, int]]] = []
    done = threading.Event()

    def watch() -> None:
        start = time.perf_counter()
        while True:
            samples.append((time.perf_counter() - start, sample(args.device)))
            if done.wait(args.every):
                samples.append((time.perf_counter() - start, sample(args.device)))
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.perf_counter()
    finished = subprocess.run(command, stdout=subprocess.DEVNULL, check=False)
    elapsed = time.perf_counter() - started
    done.set()
    watcher.join()
    print(f"exit {finished.returncode} in {elapsed:.2f} s: {' '.join(command)}")
    print("| s | read GB/s | MiB/read | write GB/s | MiB/write |")
    print("|---:|---:|---:|---:|---:|")
    for (t0, a), (t1, b) in itertools.pairwise(samples):
        seconds = max(t1 - t0, 1e-9)
        reads, read_sectors = b[0] - a[0], b[1] - a[1]
        writes, write_sectors = b[2] - a[2], b[3] - a[3]
        print(
            f"| {t1:.1f} | {read_sectors * SECTOR / seconds / 1e9:.2f} | "
            f"{read_sectors * SECTOR / reads / 2**20 if reads else 0:.1f} | "
            f"{write_sectors * SECTOR / seconds / 1e9:.2f} | "
            f"{write_sectors * SECTOR / writes / 2**20 if writes else 0:.1f} |"
        )


if __name__ == "__main__":
    main()
