"""What the bench scripts share: sizes on disk, timed subprocess runs, the results table."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
"""The checkout these benches belong to."""

Row = tuple[str, float, float | None, int, float, float, int]
"""(name, seconds, ckptctl's own seconds or None, bytes written, source bytes/s, vs cp, RSS)."""


def files_of(path: Path) -> list[Path]:
    """``path`` itself if a file, else every file under it."""
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in files_of(path))


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class Timing(NamedTuple):
    seconds: float
    """Wall seconds until the output is on disk (the run plus a ``sync``)."""
    rss: int
    """Peak RSS in bytes (GNU time)."""
    inner: float | None
    """ckptctl's own ``--json`` seconds, if it printed them."""
    cpu: float
    """User plus system CPU seconds of the run (GNU time). On a virtual machine whose host
    takes back the memory the guest leaves free, touching that memory again shows up here as
    system time (measured 2026-11-28: bench/HISTORY.md)."""


PRIME_BYTES = 8 << 30
"""Free memory passed through the page cache (then freed) before each timed run: enough that
the host of this VM, which takes back free guest memory at a limited rate, has not reached what
a run allocates before the run ends (measured 2026-11-28: 0.8 GiB written 8 s
after freeing 8 GiB ran at 4.4 GB/s, after freeing 2 GiB at 0.44 GB/s)."""

FILL = "import sys; block = bytearray(b'\\x01') * int(sys.argv[1])"

PRIMER_CHUNK = 16 << 20
"""Bytes read per call while priming."""


def fill_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of memory in a process of its own, which then exits and frees it."""
    subprocess.run([sys.executable, "-c", FILL, str(nbytes)], check=True)


def fill_page_cache(nbytes: int, where: Path) -> None:
    """Bring ``nbytes`` of page cache into memory, then free it: read a sparse file of that
    size made in the folder ``where`` (its holes cost no disk read and no disk space), then
    evict its pages and remove it. Where the file system keeps no page cache of holes (tmpfs
    maps them to one zero page) this touches nothing, and costs nothing."""
    fd, name = tempfile.mkstemp(prefix=".ckptctl-bench-prime-", dir=where)
    try:
        os.ftruncate(fd, nbytes)
        buffer = memoryview(bytearray(PRIMER_CHUNK))
        offset = 0
        while offset < nbytes:
            got = os.preadv(fd, [buffer], offset)
            if got <= 0:
                break
            offset += got
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        os.unlink(name)


def free_memory() -> int:
    """The machine's free memory in bytes (``MemFree``: not counting the page cache)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemFree:"):
            return int(line.split()[1]) * 1024
    return 0


def memory_needed(source_bytes: int) -> int:
    """What a run over a source of ``source_bytes`` brings into memory, at most: the output's
    pages and, from a cold cache, the source's (``prime_memory``'s ``need``)."""
    return 2 * source_bytes


def prime_memory(need: int = 0, where: Path | None = None) -> None:
    """Pass ``PRIME_BYTES`` of the machine's free memory, or ``need`` if more (never evicting
    the page cache: 1 GiB stays free), through the page cache and free it again
    (``fill_page_cache`` in ``where``, default the temporary folder), so a run that follows gets
    pages its host backs already.
    Some virtual machines (this one) hand free guest memory back to the host, and the next
    touch of it waits for the host: ~2 s of system time per GB here, for `cp` as for ckptctl,
    more for whichever runs later after a free. Priming starts every run from memory the host
    backs, as on bare metal, where this costs a few tenths of a second and changes nothing.
    Through the page cache, not anonymous memory: measured (2026-11-28, bench/HISTORY.md),
    a page-cache write right after 4 GiB of anonymous memory was touched and freed ran no
    faster than after none, and as fast as right after a free once the 4 GiB had passed
    through the page cache (a cold `cp -r` of the 2.28 GB bench source: 3.5-4.2 s after
    anonymous priming, 0.86-0.93 s after page-cache priming, 1.6-3.2 s after none).
    A run that brings more into memory than was primed runs at the host's pace once past it:
    `cp -r` of a cold 7.9 GB source (16 GB of page cache, read and written) took 23-24 s after
    8 GiB were primed, 7.8-9.5 s after 22 GiB."""
    nbytes = min(max(PRIME_BYTES, need), free_memory() - (1 << 30))  # (tests lower PRIME_BYTES)
    if nbytes > 0:
        fill_page_cache(nbytes, where or Path(tempfile.gettempdir()))


def timed(
    cmd: list[str],
    env: dict[str, str] | None = None,
    prime: bool = True,
    need: int = 0,
    where: Path | None = None,
) -> Timing:
    """Time ``cmd``. Counting the final sync charges every run for its own writeback, so runs
    compare at the disk's bandwidth, not the page cache's. ``env``: the command's environment
    (default: this process's). ``prime``: start from primed memory (``prime_memory``, with
    ``need``, in the folder ``where``)."""
    if prime:
        prime_memory(need, where)
    start = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M %U %S", *cmd],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
    inner = json.loads(done.stdout)["seconds"] if "--json" in cmd else None
    rss, user, system = done.stderr.strip().splitlines()[-1].split()
    return Timing(seconds, int(rss) * 1024, inner, float(user) + float(system))


def compile_bytecode(root: Path = ROOT) -> None:
    """Compile ckptctl's modules (of the checkout at ``root``) to bytecode, as ``pip install``
    does: a process started with ``PYTHONDONTWRITEBYTECODE`` (set on some machines, this one
    included) otherwise compiles every ckptctl source file again at each start, ~0.15 s that no
    installed copy pays."""
    for package in ("ckptctl", "planners"):
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(root / package)],
            check=True,
            stdout=subprocess.DEVNULL,
        )


CKPTCTL_IN_CHECKOUT = [sys.executable, "-P", "-m", "ckptctl"]
"""ckptctl of the checkout that ``checkout_env`` names. ``-P``: ``python -m`` would otherwise put
the working directory first on ``sys.path``, and a bench started from a checkout's root would run
that checkout's code whatever ``PYTHONPATH`` says (it did: until this was added, ``bench_ab.py``
started from the repository's root ran the new code on both sides)."""


def checkout_env(root: Path) -> dict[str, str]:
    """The environment in which ``CKPTCTL_IN_CHECKOUT`` runs the checkout at ``root``."""
    return dict(os.environ, PYTHONPATH=str(root))


def imported_checkout(env: dict[str, str]) -> Path:
    """The checkout whose ckptctl (and planners) a ``CKPTCTL_IN_CHECKOUT`` process with ``env``
    imports; a bench comparing two checkouts checks each side against it before timing."""
    probe = "import ckptctl, planners; print(ckptctl.__file__); print(planners.__file__)"
    done = subprocess.run(
        [*CKPTCTL_IN_CHECKOUT[:2], "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    roots = {Path(line).resolve().parent.parent for line in done.stdout.split()}
    if len(roots) != 1:
        sys.exit(f"ckptctl and planners come from different trees: {sorted(roots)}")
    return roots.pop()


def drop_caches() -> None:
    """Empty the page cache (root only): every file, the source's and Python's and torch's
    own, then comes from the disk."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as err:
        sys.exit(f"--cold needs to drop the page cache (root): {err}")


def read_all(source: Path) -> None:
    """Read every file of ``source`` (a file or a folder) once, as ``cat`` does."""
    subprocess.run(["cat", *map(str, files_of(source))], stdout=subprocess.DEVNULL, check=True)


def read_through_cache(files: list[Path], call: int) -> int:
    """Read every file of ``files`` into the page cache in ``call``-byte ``sendfile`` calls to
    ``/dev/null`` (as ckptctl's source reader does: no copy to user space); the bytes read."""
    read = 0
    sink = os.open(os.devnull, os.O_WRONLY)
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                offset = 0
                while offset < size:
                    n = os.sendfile(sink, fd, offset, min(call, size - offset))
                    if n <= 0:  # the file shrank meanwhile
                        break
                    offset += n
                read += offset
            finally:
                os.close(fd)
    finally:
        os.close(sink)
    return read


def evict(source: Path) -> None:
    """Take ``source``'s pages (a file or a folder) out of the page cache, and only those
    (``posix_fadvise`` ``DONTNEED`` after a ``sync``; any user may): a cold checkpoint read by a
    process whose Python, modules and tools are in memory, as on a node that has just run
    them."""
    subprocess.run(["sync"], check=True)
    for path in files_of(source):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Cold(NamedTuple):
    """How a cold attempt starts: ``source`` read, then either the whole page cache emptied
    (``everything``, root: Python's modules come from the disk too) or the source's pages
    evicted alone. The read first: under a virtual machine the host keeps a cache of its own
    that the guest cannot drop; without it, it holds whatever the attempt before had read
    (measured: cold ``cp -r`` took 1.9-2.1 s after a ``cp``, 4.8-4.9 s after a ckptctl job)."""

    source: Path
    everything: bool = True

    def start(self) -> None:
        read_all(self.source)
        if self.everything:
            drop_caches()
        else:
            evict(self.source)

    def describe(self) -> str:
        what = "the page cache emptied" if self.everything else "its pages evicted"
        return f"source read, then {what}, before each attempt"


def add_cold_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--cold",
        action="store_true",
        help="Before each attempt read the source, then empty the whole page cache (root).",
    )
    group.add_argument(
        "--cold-source",
        action="store_true",
        help="Before each attempt read the source, then evict its pages alone (any user).",
    )


def add_cold_path_options(parser: argparse.ArgumentParser) -> None:
    """``--cold SRC`` / ``--cold-source SRC`` for a tool timing one command (the source is
    named here, not by the command's own options)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cold", type=Path, help="Read it, then empty the page cache (root).")
    group.add_argument(
        "--cold-source", type=Path, help="Read it, then evict its pages alone (any user)."
    )


def cold_of_paths(args: argparse.Namespace) -> Cold | None:
    """The cold start the options of ``add_cold_path_options`` asked for."""
    if args.cold is not None:
        return Cold(args.cold)
    if args.cold_source is not None:
        return Cold(args.cold_source, everything=False)
    return None


def cold_of(args: argparse.Namespace, source: Path) -> Cold | None:
    """The cold start the options of ``add_cold_options`` asked for, of ``source``."""
    if args.cold or args.cold_source:
        return Cold(source, everything=args.cold)
    return None


def cache_for(args: argparse.Namespace, source: Path) -> tuple[Cold | None, str]:
    """The cold start the options of ``add_cold_options`` asked for, or else the page cache
    set warm (``warm_page_cache``); with how, for the table's caption."""
    cold = cold_of(args, source)
    return cold, cold.describe() if cold else warm_page_cache(source)


def attempt(
    cmd: list[str],
    out: Path,
    cold: Cold | None = None,
    env: dict[str, str] | None = None,
    prime: bool = True,
    need: int = 0,
) -> Timing:
    """One timed run of ``cmd`` from a clean state: its output ``out`` removed and synced;
    with ``cold``, started cold (``Cold.start``);
    then ``timed`` (``need``: the bytes the run brings into memory, its output and a cold
    source, primed if more than ``PRIME_BYTES``)."""
    remove(out)
    subprocess.run(["sync"], check=True)
    check_free_space(out, need)
    if cold is not None:
        cold.start()
    return timed(cmd, env, prime, need, existing_folder(out))


FREE_MARGIN = 4 << 30
"""Free bytes a run must leave on its output's file system."""


def existing_folder(path: Path) -> Path:
    """The nearest of ``path``'s folders (``path`` itself if one) that exists."""
    while not path.is_dir():
        path = path.parent
    return path


def check_free_space(out: Path, need: int) -> None:
    """Refuse to time a run on a nearly full file system: there each write waits for ext4's
    search for free blocks (and a thinly provisioned virtual disk for its host), so the
    figure is the allocator's, not the job's. Found when this VM's disk filled with a
    session's outputs (16 KB free) and a warm merge's system time swung from 1.2 to 3.7 s.
    ``need``: the bytes the run may write (its output, with room to spare)."""
    where = existing_folder(out)
    free = shutil.disk_usage(where).free
    if free < need + FREE_MARGIN:
        sys.exit(
            f"{where}: {free / 1e9:.1f} GB free, and this run may write {need / 1e9:.1f} GB; "
            f"timings on a file system this full measure its allocator: free at least "
            f"{(need + FREE_MARGIN - free) / 1e9:.1f} GB first (old outputs under /tmp?)"
        )


def warm_page_cache(*sources: Path) -> str:
    """Start warm runs from the same memory every time: as root, empty the page cache first
    (files of earlier runs, kept outputs and other benches' sources otherwise fill memory, and
    every page a run then writes waits for reclaim: measured here, the same consolidation took
    6-7 s with 0.4 GB free and 1.7 s after this), then read the sources and import what the
    runs import. Returns how the cache was set, for the table's caption."""
    emptied = os.geteuid() == 0
    if emptied:
        drop_caches()
    for source in sources:
        read_all(source)
    imports = "import numpy, xxhash, pydantic, typer, ckptctl.cli.main, ckptctl.pipeline.execute"
    subprocess.run([sys.executable, "-c", imports], check=True, cwd=ROOT)
    return "page cache emptied, then the source read" if emptied else "page cache warm"


def measure(
    runs: list[tuple[str, list[str], Path]],
    size: int,
    repeat: int,
    keep: Collection[Path] = (),
    cold: Cold | None = None,
) -> list[Row]:
    """Each run's best of ``repeat`` (the machine is shared and noisy), as table rows whose rate
    is ``size`` source bytes per second, relative to the first run (the machine's ``cp``).
    Attempts go round robin (every run once, then again), so that a slow spell of the shared
    disk falls on all of them alike instead of on one row. Outputs are removed after each
    attempt, except the last one of those in ``keep``. ``cold``: each attempt starts cold
    (``Cold.start``)."""
    compile_bytecode()
    bests: list[Any] = [None] * len(runs)
    for round_ in range(repeat):
        for i, (_, cmd, out) in enumerate(runs):
            seconds, rss, inner, _ = attempt(cmd, out, cold, need=memory_needed(size))
            run = (seconds, rss, du(out), inner)
            bests[i] = run if bests[i] is None or seconds < bests[i][0] else bests[i]
            if not (round_ == repeat - 1 and out in keep):
                remove(out)
    rows: list[Row] = []
    for (name, _, _), best in zip(runs, bests, strict=True):
        seconds, rss, written, inner = best
        rate = size / seconds
        first = rows[0][4] if rows else rate
        rows.append((name, seconds, inner, written, rate, rate / first, rss))
    return rows


def print_table(rows: list[Row], source: str, footnote: str) -> None:
    print(f"\nsource: {source}; times include a final sync (output on disk)\n")
    print("| run | seconds | of which converting | GB written | source GB/s | vs cp | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, seconds, inner, written, rate, ratio, rss in rows:
        converting = f"{inner:.2f}" if inner is not None else "-"
        print(
            f"| {name} | {seconds:.2f} | {converting} | {written / 1e9:.2f} | "
            f"{rate / 1e9:.2f} | {ratio:.2f}x | {rss / 2**20:.0f} MiB |"
        )
    print(f"\n{footnote}")
