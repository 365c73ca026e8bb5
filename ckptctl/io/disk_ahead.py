"""Read a file's source bytes into the page cache ahead of the thread writing it.

From a cold page cache, the source bytes a writer moves come in as its mapped pages fault,
each fault waiting for its read: the disk sees reads of ~0.8 MiB about two at a time and
streams at a fraction of its speed (a TP2 PP2 -> TP4 PP1 reshard of a 2.28 GB checkpoint read
at 0.8 GB/s where ``cp`` reads the same files at 1.4 GB/s, four to five requests deep;
block-layer trace, 2026-11-27). A ``DiskAhead`` thread reads the byte ranges the writer will
read, in its order, by ``sendfile`` to ``/dev/null``: the kernel's own read-ahead brings the
pages in (no copy to user space; ``posix_fadvise(WILLNEED)`` was tried and fills the cache
with single pages, which the disk gets as short requests). It keeps at most ``AHEAD`` bytes
ahead of what the writer has consumed, so a checkpoint larger than memory is not read into it
faster than it is used, and stops with the file. Only a hint: where the call fails or does not
exist, nothing changes but speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ckptctl.io import writeback

PIECE = 4 << 20
"""Bytes read per call (between two looks at whether to stop; ``DiskAhead``: at how far the
writer has come)."""


def available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def read_into_cache(fd: int, offset: int, nbytes: int, sink: int) -> None:
    """Bring ``nbytes`` of ``fd`` from ``offset`` into the page cache: ``sendfile`` to
    ``sink`` (``/dev/null``) reads them through the cache and copies nothing."""
    while nbytes > 0:
        n = os.sendfile(sink, fd, offset, nbytes)
        if n <= 0:  # the end of the file
            return
        offset, nbytes = offset + n, nbytes - n


def byte_cached(fd: int, offset: int) -> bool:
    """Whether byte ``offset`` of ``fd`` is in the page cache: a one-byte ``RWF_NOWAIT`` read,
    which returns at once instead of waiting for the disk (``False`` where the flag is
    missing)."""
    try:
        return os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT) == 1
    except (OSError, AttributeError):  # not cached (EAGAIN), or no such flag here
        return False


AHEAD = 256 << 20
"""Bytes of the writer's reads asked of the disk beyond what it has consumed."""

POLL = 0.02
"""Seconds between looks at the writer's progress while far enough ahead (each look takes the
GIL from the threads doing the work)."""

GAP = 1 << 20
"""Ranges of one file closer than this are asked as one (the bytes between are few and the
disk reads them in passing)."""


@dataclass
class Extent:
    """Bytes ``[offset, offset + nbytes)`` of local file ``path`` that a read touches, for
    ``weight`` bytes of what the writer consumes (a column half of a tensor touches every page
    of its rows: twice its own bytes)."""

    path: str
    offset: int
    nbytes: int
    weight: int


def merged(extents: Iterable[Extent], gap: int = GAP) -> list[Extent]:
    """Consecutive extents of one file that touch or come within ``gap``, asked as one."""
    out: list[Extent] = []
    for e in extents:
        last = out[-1] if out else None
        end = last.offset + last.nbytes if last else 0
        if last and last.path == e.path and last.offset <= e.offset <= end + gap:
            last.nbytes = max(end, e.offset + e.nbytes) - last.offset
            last.weight += e.weight
        else:
            out.append(Extent(e.path, e.offset, e.nbytes, e.weight))
    return out


SPAN_GAP = 64 << 20
"""Ranges of one file closer than this are read as one span by ``SourceReader``: a sequential
read through a few unneeded MiB costs less than breaking the disk's stream."""


def in_file_order(extents: Iterable[Extent], gap: int = SPAN_GAP) -> list[Extent]:
    """The files the extents touch, each read once from its first needed byte to its last
    (ranges ``gap`` or more apart are read apart), in the order the job first needs them.
    Each span starts on a multiple of ``PIECE``: read from a zip record's odd offset
    (19,712 for a Megatron shard), every piece straddles pages and the disk gets 1.7 MiB
    requests where it gets 2.2 MiB from aligned pieces (the 2.28 GB of a TP2 PP2 checkpoint's
    spans, cold: 0.93-1.10 s against 0.77-1.04 s, 4 rounds)."""
    by_file: dict[str, list[Extent]] = {}
    for e in extents:
        by_file.setdefault(e.path, []).append(e)
    spans = merged(
        (e for ranges in by_file.values() for e in sorted(ranges, key=lambda e: e.offset)), gap
    )
    for span in spans:  # (spans of a file lie ``gap`` > ``PIECE`` apart: none come to overlap)
        before = span.offset % PIECE
        span.offset, span.nbytes = span.offset - before, span.nbytes + before
    return spans


STREAM_PIECE = 256 << 20
"""Bytes ``SourceReader`` reads per call. Each call returns to Python, and the thread then
waits for the GIL, which the job's other threads hold for up to the interpreter's switch
interval (5 ms) at a time: in 4 MiB calls (1.2 ms of disk time each) the stream of a cold
2.28 GB source read at 0.78 GB/s beside one busy Python thread, against 3.4 GB/s alone; in
64 MiB calls at 2.6 GB/s, in 512 MiB calls at 3.0 GB/s. A whole TP2 PP2 -> TP4 PP1 reshard,
cold source, 4 interleaved rounds, medians: 2.16 s in 4 MiB calls, 2.03 s in 256 MiB calls
(and 1.88 s with ``read_early``'s calls of 64 MiB), against 1.84-1.86 s for ``cp -r``. A
warm job passes a span's cached pieces by (``cached``); a cold one's ``close`` waits for the
current call (0.1 s at most at this disk's speed)."""


class SourceReader:
    """Reads a job's local source bytes into the page cache as ``cp`` reads them: each file
    in one sequential stream from its first needed byte to its last, the files in the order
    the job first needs them, as fast as the disk goes, from when the plan is known. The
    writers' own read-ahead (``DiskAhead``, page faults) then finds most pages in memory.

    Without it, a cold merge's band builders, the disk-ahead thread and the writer read at
    once, in ~1.2 MiB requests where ``cp`` reads 3.8 MiB ones. ``cat`` of the shard files
    started as the job starts converting took its median from 3.37 to 3.14 s (5 interleaved
    rounds). While it reads, early writeback waits (``writeback.hold``): the device reads,
    then writes, as for ``cp`` and ``sync``. Only when what it reads is at most half of the
    memory available: a larger source read ahead unpaced would push out pages before the job
    uses them (``DiskAhead`` keeps pace with the writer then), and its output could not wait
    in memory.
    """

    def __init__(self, extents: Iterable[Extent]) -> None:
        spans = in_file_order(extents)
        nbytes = sum(e.nbytes for e in spans)
        self._reading: DiskAhead | None = None
        self._held = False
        self._lock = threading.Lock()
        if spans and nbytes <= available_memory() // 2:
            writeback.hold()
            self._held = True
            try:
                self._reading = DiskAhead(
                    spans,
                    lambda: 0,
                    nbytes + 1,
                    self._release,
                    name="ckptctl-source-reader",
                    piece=STREAM_PIECE,
                )
            except BaseException:  # (no thread to start): the writeback must not wait forever
                self._release()
                raise

    @property
    def active(self) -> bool:
        return self._reading is not None

    @property
    def holding(self) -> bool:
        """Whether the writeback still waits for this reader."""
        return self._held

    def _release(self) -> None:
        with self._lock:
            if self._held:
                self._held = False
                writeback.release()

    def close(self) -> None:
        if self._reading is not None:
            self._reading.close()
            self._reading = None
        self._release()


PAGE = mmap.PAGESIZE


def _pages_of(offset: int, nbytes: int) -> int:
    first = offset - offset % PAGE
    return (offset + nbytes - first + PAGE - 1) // PAGE


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


CACHESTAT = 451
"""The syscall's number (Linux 6.5): numbers from 424 on are shared by every architecture
but alpha; a kernel without it answers ``ENOSYS``."""


@functools.cache
def _syscall() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_long
    return function


def cached_pages(fd: int, offset: int, nbytes: int) -> int | None:
    """Pages of the range in the page cache (``cachestat(2)``); ``None`` where the system
    cannot tell (not Linux, a kernel before 6.5, a file system that refuses)."""
    syscall = _syscall()
    if syscall is None:
        return None
    span = _CachestatRange(offset - offset % PAGE, _pages_of(offset, nbytes) * PAGE)
    stat = _Cachestat()
    flags = ctypes.c_uint(0)
    if syscall(CACHESTAT, ctypes.c_int(fd), ctypes.byref(span), ctypes.byref(stat), flags) != 0:
        return None
    return int(stat.nr_cache)


def counted_cached(fd: int, offset: int, nbytes: int) -> bool | None:
    """Whether every page of the range is in the page cache, as ``cachestat(2)`` counts them
    (nothing is read); ``None`` where it cannot tell."""
    counted = cached_pages(fd, offset, nbytes)
    return None if counted is None else counted >= _pages_of(offset, nbytes)


def cached(fd: int, offset: int, nbytes: int) -> bool:
    """Whether the range is in the page cache already (then reading it again would only cost
    CPU: a warm job's). Asked of ``cachestat(2)`` (Linux 6.5), which counts the range's pages
    and reads nothing. Elsewhere, a one-byte ``RWF_NOWAIT`` read of each end of the range:
    it starts the kernel's read-ahead at the range's end itself, and calls a range cached whose
    middle is not (the merge's read list replayed cold: once in three, 0.6 of its 2.3 GB were
    skipped so, left to the writer's page faults)."""
    counted = counted_cached(fd, offset, nbytes)
    if counted is not None:
        return counted
    return byte_cached(fd, offset) and byte_cached(fd, offset + nbytes - 1)


class DiskAhead:
    """A thread reading ``extents`` into the page cache in order, at most ``ahead`` bytes
    (weighed as the writer consumes them) beyond ``consumed()``; ``close`` stops it."""

    def __init__(
        self,
        extents: Iterable[Extent],
        consumed: Callable[[], int],
        ahead: int = AHEAD,
        done: Callable[[], object] | None = None,
        name: str = "ckptctl-disk-ahead",
        piece: int = PIECE,
    ) -> None:
        self._extents = merged(extents)
        self._piece = piece
        self._done = done
        """Called on the thread once it has read everything, stopped or failed."""
        start = consumed()  # a writer's count runs on over the files it writes
        self._consumed = lambda: consumed() - start
        self._ahead = ahead
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def _run(self) -> None:
        asked = 0.0  # weight asked so far
        fds: dict[str, int] = {}  # the source files, each opened once
        sink = -1
        try:
            sink = os.open(os.devnull, os.O_WRONLY)
            for extent in self._extents:
                per_byte = extent.weight / extent.nbytes if extent.nbytes else 0.0
                for start in range(extent.offset, extent.offset + extent.nbytes, self._piece):
                    if self._stop.is_set():
                        return
                    n = min(self._piece, extent.offset + extent.nbytes - start)
                    fd = fds.get(extent.path)
                    if fd is None:
                        fd = fds[extent.path] = os.open(extent.path, os.O_RDONLY)
                    if not cached(fd, start, n):  # a warm job passes through without waiting
                        while asked - self._consumed() > self._ahead:
                            if self._stop.wait(POLL):
                                return
                        read_into_cache(fd, start, n, sink)
                    asked += n * per_byte
        except (OSError, AttributeError):  # only a hint: the writer reads what it needs anyway
            return
        finally:
            for fd in [sink, *fds.values()]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if self._done is not None:
                self._done()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
