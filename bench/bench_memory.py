"""Does this machine's host take back the memory its guest leaves free? If it does, every time
table here swings with it, `cp`'s included.

Some virtual machines hand memory the guest has freed back to the host, which reclaims it a few
seconds later; the next touch of such a page waits for the host to back it again, and that wait
is counted as the guest's system time. Page-cache writes allocate a fresh page per 4 KiB, so a
copy pays it for every byte it writes, and a cold copy for every byte it reads too.

Each trial frees ``--free`` GiB of touched memory (a process that fills it, then exits), waits
either not at all or ``--idle`` seconds, then times a process that writes ``--write`` GiB into a
new file in 4 MiB calls (page cache only: no sync is timed). Two more states wait ``--idle``
seconds, then prime ``--prime`` GiB first, as the benches do (``benchlib.prime_memory``):
through the page cache, or (as the benches did before 2026-11-28) by touching anonymous
memory in a process that then exits. Trials alternate, ``--rounds`` each.

    python bench/bench_memory.py [--rounds 3] [--idle 8] [--free 2] [--write 0.8] [--prime 4]
                                 [--dir /tmp]

Prints medians: wall and system seconds and GB/s of each state. On bare metal the rows agree;
on this VM (2026-11-25) the write took ~0.2 s of system time right after the free and ~1.8 s
after 8 s idle.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import fill_memory, fill_page_cache

WRITE = r"""
import os, resource, sys, time
path, nbytes = sys.argv[1], int(float(sys.argv[2]) * (1 << 30))
block = b"\x01" * (4 << 20)
start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
for _ in range(nbytes // len(block)):
    os.write(fd, block)
os.close(fd)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_stime - before)
"""


def trial(
    idle: float, free: float, write: float, target: Path, primer: str, prime: float
) -> tuple[float, float]:
    """(wall, system) seconds of one page-cache write, ``idle`` seconds after a free, after
    ``prime`` GiB were primed by ``primer`` (a key of ``PRIMERS``)."""
    fill_memory(int(free * (1 << 30)))
    time.sleep(idle)
    if primer == "page cache":
        fill_page_cache(int(prime * (1 << 30)), target.parent)
    elif primer == "anonymous":
        fill_memory(int(prime * (1 << 30)))
    done = subprocess.run(
        [sys.executable, "-c", WRITE, str(target), str(write)],
        check=True,
        capture_output=True,
        text=True,
    )
    target.unlink()
    subprocess.run(["sync"], check=True)
    wall, system = (float(x) for x in done.stdout.split())
    return wall, system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=8.0, help="Seconds the memory sits free.")
    parser.add_argument("--free", type=float, default=2.0, help="GiB freed before each write.")
    parser.add_argument("--write", type=float, default=0.8, help="GiB written per trial.")
    parser.add_argument("--prime", type=float, default=4.0, help="GiB primed, where primed.")
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="Where the file goes.")
    args = parser.parse_args()
    target = args.dir / "ckptctl-bench-memory.bin"
    after = f"{args.idle:g} s after the free"
    states = {
        "right after the free": (0.0, "none"),
        after: (args.idle, "none"),
        f"{after}, then {args.prime:g} GiB primed through the page cache": (
            args.idle,
            "page cache",
        ),
        f"{after}, then {args.prime:g} GiB of anonymous memory primed": (args.idle, "anonymous"),
    }
    seen: dict[str, list[tuple[float, float]]] = {state: [] for state in states}
    for _ in range(args.rounds):
        for state, (idle, primer) in states.items():
            seen[state].append(trial(idle, args.free, args.write, target, primer, args.prime))
    nbytes = args.write * (1 << 30)
    print(f"\n{args.write:g} GiB written into the page cache, {args.rounds} rounds, medians\n")
    print("| memory freed | wall s | system s | GB/s |")
    print("|---|---:|---:|---:|")
    for state, trials in seen.items():
        wall = statistics.median(w for w, _ in trials)
        system = statistics.median(s for _, s in trials)
        print(f"| {state} | {wall:.2f} | {system:.2f} | {nbytes / wall / 1e9:.2f} |")


if __name__ == "__main__":
    main()
