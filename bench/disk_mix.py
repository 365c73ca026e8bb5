"""What the disk itself does with a converter's I/O, without a converter: read a checkpoint's
files cold, write as many bytes to a new file, one after the other and both at once.

A cold table's ratio to `cp` is only as stable as the disk. On the virtual machine these
benches run on, the host throttles its disk by what it has moved lately, so the same bytes
take several times longer after a busy moment; and a job that reads and writes at once (as
ckptctl's streaming jobs do) and `cp` (which reads every file, then lets the kernel write)
meet different limits. This script shows which state the disk is in and what each pattern
costs there, with the kernel's own moves and no Python work per byte:

* ``read``: the files by ``sendfile`` to ``/dev/null``, 4 MiB per call (what ``cp`` reads);
* ``write``: the same number of bytes into a new file in 1 MiB ``pwrite``s, asking for
  writeback every 32 MiB as ckptctl does, then ``fsync``;
* ``read, then write``: both in turn in one process;
* ``read and write at once``: both on two threads (a streaming converter's pattern);
* ``cp -r``: the files copied, then ``sync`` (what the benches' ratios divide by).

Each attempt starts with the files' pages evicted and the output removed; patterns go round
robin so that a slow spell falls on all of them. GB/s and request sizes come from
``/proc/diskstats``.

    python bench/disk_mix.py [--source /tmp/ckptctl-bench/src] [--rounds 2] [--device vda]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import evict, files_of, read_through_cache
from disk_trace import SECTOR, sample

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptctl.writeback import start_writeback

READ_CALL = 4 << 20
WRITE_CALL = 1 << 20
WRITEBACK_EVERY = 32 << 20


def read(files: list[Path]) -> None:
    read_through_cache(files, READ_CALL)


def write(out: Path, nbytes: int) -> None:
    block = os.urandom(WRITE_CALL)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        asked = 0
        for offset in range(0, nbytes, WRITE_CALL):
            os.pwrite(fd, block[: min(WRITE_CALL, nbytes - offset)], offset)
            end = min(offset + WRITE_CALL, nbytes)
            if end - asked >= WRITEBACK_EVERY:
                start_writeback(fd, asked, end - asked)
                asked = end
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(job: Callable[[], None]) -> float:
    started = time.perf_counter()
    job()
    return time.perf_counter() - started


def in_turn(*jobs: Callable[[], None]) -> list[float]:
    return [timed(job) for job in jobs]


def at_once(*jobs: Callable[[], None]) -> list[float]:
    seconds = [0.0] * len(jobs)

    def run(i: int) -> None:
        seconds[i] = timed(jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("/tmp/ckptctl-bench/src"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/ckptctl-bench-disk-mix.bin"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="vda")
    args = parser.parse_args()
    files = files_of(args.source)
    nbytes = sum(f.stat().st_size for f in files)
    if not nbytes:
        sys.exit(f"{args.source}: no files to read (make one with bench_convert.py --keep)")
    reading, writing = (lambda: read(files)), (lambda: write(args.out, nbytes))
    copy = args.out.with_suffix(".copy")
    patterns: dict[str, Callable[[], list[float]]] = {
        "read": lambda: in_turn(reading),
        "write": lambda: in_turn(writing),
        "read, then write": lambda: in_turn(reading, writing),
        "read and write at once": lambda: at_once(reading, writing),
        "cp -r": lambda: in_turn(
            lambda: subprocess.run(["cp", "-r", str(args.source), str(copy)], check=True),
            lambda: subprocess.run(["sync"], check=True),
        ),
    }
    rows: list[tuple[int, str, float, list[float], tuple[int, ...]]] = []
    for round_ in range(args.rounds):
        for name, run in patterns.items():
            args.out.unlink(missing_ok=True)
            shutil.rmtree(copy, ignore_errors=True)
            evict(args.source)  # (after a ``sync``: the removed output's blocks are freed first)
            before, started = sample(args.device), time.perf_counter()
            parts = run()
            seconds, after = time.perf_counter() - started, sample(args.device)
            moved = tuple(b - a for a, b in zip(before, after, strict=True))
            rows.append((round_ + 1, name, seconds, parts, moved))
    args.out.unlink(missing_ok=True)
    shutil.rmtree(copy, ignore_errors=True)
    print(f"\n{nbytes / 1e9:.2f} GB read from {args.source} and/or written; pages evicted first\n")
    print(
        "| round | pattern | seconds | of which read / write (cp: copy / sync) | read GB/s "
        "| MiB/read | write GB/s | MiB/write |"
    )
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for round_, name, seconds, parts, (reads, read_sectors, writes, write_sectors) in rows:
        read_bytes, write_bytes = read_sectors * SECTOR, write_sectors * SECTOR
        split = " / ".join(f"{part:.2f}" for part in parts) if len(parts) > 1 else "-"
        print(
            f"| {round_} | {name} | {seconds:.2f} | {split} | {read_bytes / seconds / 1e9:.2f} | "
            f"{read_bytes / reads / 2**20 if reads else 0:.1f} | "
            f"{write_bytes / seconds / 1e9:.2f} | "
            f"{write_bytes / writes / 2**20 if writes else 0:.1f} |"
        )


if __name__ == "__main__":
    main()
