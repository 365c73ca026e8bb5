"""How fast one thread streams a cold source into the page cache beside busy Python threads,
by the size of its calls: each call returns to Python, and the thread then waits for the GIL.

Reads every file of ``SRC`` by ``sendfile`` to ``/dev/null`` (as ``disk_ahead.SourceReader``
does), from a cold source (read, then its pages evicted; memory primed), ``--busy`` threads
running pure Python meanwhile:

    python bench/stream_gil.py SRC [--pieces 4 64 512] [--busy 0 1] [--rounds 2]

Measured (2026-11-28, the 2.28 GB bench source): 3.4 GB/s alone in 4 MiB calls; beside one
busy thread 0.78 GB/s in 4 MiB calls, 2.6 GB/s in 64 MiB calls, 3.0 GB/s in 512 MiB calls.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from benchlib import Cold, files_of, prime_memory, read_through_cache


def spin(stop: threading.Event) -> None:
    """Pure Python that holds the GIL but for the interpreter's switches."""
    total = 0
    while not stop.is_set():
        for i in range(1000):
            total += i


def timed(source: Path, piece: int, busy: int) -> float:
    """GB/s of one cold stream in ``piece``-byte calls beside ``busy`` spinning threads."""
    Cold(source, everything=False).start()
    prime_memory()
    stop = threading.Event()
    spinners = [threading.Thread(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
    for thread in spinners:
        thread.start()
    try:
        start = time.perf_counter()
        nbytes = read_through_cache(sorted(files_of(source)), piece)
        seconds = time.perf_counter() - start
    finally:
        stop.set()
        for thread in spinners:
            thread.join()
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("--pieces", type=int, nargs="+", default=[4, 64, 512], help="MiB.")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="Busy threads.")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    seen: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for busy in args.busy:
            for piece in args.pieces:
                rate = timed(args.source, piece << 20, busy)
                seen.setdefault((busy, piece), []).append(rate)
    print("\n| busy Python threads | call size | GB/s, each round |")
    print("|---:|---:|---|")
    for (busy, piece), rates in seen.items():
        print(f"| {busy} | {piece} MiB | {' '.join(f'{r:.2f}' for r in rates)} |")


if __name__ == "__main__":
    main()
