"""What the bench scripts share: sizes on disk, timed subprocess runs, the results table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

Row = tuple[str, float, float | None, int, float, float, int]
"""(name, seconds, ckptctl's own seconds or None, bytes written, source bytes/s, vs cp, RSS)."""


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def timed(cmd: list[str]) -> tuple[float, int, float | None]:
    """Wall seconds until ``cmd``'s output is on disk (its run plus a ``sync``), its peak RSS in
    bytes (GNU time), and ckptctl's own ``--json`` seconds if it printed them. Counting the sync
    charges every run for its own writeback, so runs compare at the disk's bandwidth, not the
    page cache's."""
    start = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True, check=False
    )
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
    inner = json.loads(done.stdout)["seconds"] if "--json" in cmd else None
    return seconds, int(done.stderr.strip().splitlines()[-1]) * 1024, inner


def print_table(rows: list[Row], source: str, footnote: str) -> None:
    print(f"\nsource: {source}; page cache warm; times include a final sync (output on disk)\n")
    print("| run | seconds | of which converting | GB written | source GB/s | vs cp | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, seconds, inner, written, rate, ratio, rss in rows:
        converting = f"{inner:.2f}" if inner is not None else "-"
        print(
            f"| {name} | {seconds:.2f} | {converting} | {written / 1e9:.2f} | "
            f"{rate / 1e9:.2f} | {ratio:.2f}x | {rss / 2**20:.0f} MiB |"
        )
    print(f"\n{footnote}")
