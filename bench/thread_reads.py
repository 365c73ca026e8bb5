"""Run one ckptctl command in this process and print how many bytes each of its threads
made the disk read (``/proc/self/task/*/io``'s ``read_bytes``, by Python thread name).

What ``disk_trace.py`` cannot say: whose reads the disk served. A cold job's source should
come in through its stream (``ckptctl-read-early``, then ``ckptctl-source-reader``); bytes
read by a writer's ``ckptctl-disk-ahead``, a band reader (``ckptctl-read``) or the main
thread were read beside the stream, each such read a second position on the disk.

    python bench/thread_reads.py [--cold SRC | --cold-source SRC] -- reshard SRC OUT --tp 4
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
import threading
from pathlib import Path

from benchlib import add_cold_path_options, cold_of_paths, prime_memory, remove

EVERY = 0.005
"""Seconds between samples: a thread's count is lost with the thread, so the sampler must
look often enough to see each one's last figure before it ends."""


def thread_names() -> dict[str, str]:
    """Native thread id -> Python thread name, numbered suffixes dropped (``ckptctl-read_0``
    and ``ckptctl-read_1`` count as one)."""
    return {str(t.native_id): re.sub(r"[_-]?\d+$", "", t.name) for t in threading.enumerate()}


def read_bytes(tid: str) -> int | None:
    try:
        with open(f"/proc/self/task/{tid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:  # the thread ended
        pass
    return None


class Sampler:
    """Keeps each thread's last ``read_bytes``, by name, until ``stop``."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(EVERY):
            names = thread_names()
            for tid in os.listdir("/proc/self/task"):
                n = read_bytes(tid)
                if n is not None:
                    self.last[(tid, names.get(tid, "?"))] = n

    def totals(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        by_name: dict[str, int] = {}
        for (_, name), n in self.last.items():
            by_name[name] = by_name.get(name, 0) + n
        return dict(sorted(by_name.items(), key=lambda item: -item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cold_path_options(parser)
    parser.add_argument("--clear", type=Path, help="An output folder to remove first.")
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    arguments = args.arguments[1:] if args.arguments[:1] == ["--"] else args.arguments
    if not arguments:
        parser.error("give ckptctl's arguments after --")
    if args.clear is not None:
        remove(args.clear)
    cold = cold_of_paths(args)
    if cold is not None:
        cold.start()
        prime_memory()
    sampler = Sampler()
    exit_now = os._exit

    def report_then_exit(code: int) -> None:  # a successful command leaves by os._exit
        report(sampler, code)
        exit_now(code)

    os._exit = report_then_exit
    sys.argv = ["ckptctl", *arguments]
    try:
        runpy.run_module("ckptctl", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        report(sampler, done.code)
        raise
    report(sampler, 0)


def report(sampler: Sampler, code: object) -> None:
    totals = sampler.totals()
    print(f"read from the disk, by thread (exit {code}):", file=sys.stderr)
    for name, n in totals.items():
        if n:
            print(f"  {name:28s} {n / 1e6:10.1f} MB", file=sys.stderr)
    print(f"  {'all':28s} {sum(totals.values()) / 1e6:10.1f} MB", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
