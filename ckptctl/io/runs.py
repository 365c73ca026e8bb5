"""Runs: bytes that move from a local source file to the output unchanged.

When a target tensor (or a contiguous part of it) is a contiguous range of a source file in
the same dtype, nothing needs to pass through Python: the kernel copies the range
(``copy_file_range``; file systems that can share blocks do), and the checksums every output
carries (the zip entry's CRC-32, the tensor's and the file's xxh3) are computed from a
read-only map of the source's pages, never from a copy of them. Writers that cannot take a
kernel copy (object stores, compressed views) get the same mapped pages through ``write``.

A run is emitted by the writer that owns the output (``Run.write_to``): observers (checksums,
progress) see its bytes in order, then its ``finished`` callbacks run, on the writing thread,
so a read-ahead thread that hands runs on never finalises a checksum too early.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptctl.checksums import record_checks
from ckptctl.checksums.crc import crc32
from ckptctl.errors import CheckpointError

WRITTEN_FROM_MAPPED_PAGES = "write_from_mapped_pages"
"""How a run moves to a local file where a kernel copy would only copy through a pipe: written
from the source's mapped pages, a slice at a time (``ckptctl.io.filesystems``)."""

WINDOW = 64 << 20
"""Bytes mapped (and copied by one kernel call) at a time: bounds the pages a run keeps
mapped, so peak RSS does not grow with the source."""

Observer = Callable[[memoryview], object]


@dataclass(frozen=True, slots=True)
class Span:
    """Where a box of a tensor lies in a checkpoint's files, when it lies contiguously: bytes
    ``[offset, offset + nbytes)`` of file ``rel`` (relative to the checkpoint root), holding
    elements of ``dtype``; ``crc`` is the CRC-32 the file records for exactly these bytes (a
    whole zip entry), if any. Formats answer ``where`` with it, on any storage."""

    rel: str
    offset: int
    nbytes: int
    dtype: str
    crc: int | None = None
    record: record_checks.Record | None = None
    """The zip record a span of part of one lies in (local files), whose check the run's bytes
    go to as they are written."""


class Run:
    """Bytes ``[offset, offset + nbytes)`` of local file ``path``, holding elements of
    ``dtype``; ``crc``, when the source records one for exactly these bytes (a whole zip
    entry), is checked as they pass. With ``storage`` (an object store) the bytes are those of
    its object ``rel`` (``path`` names it in messages): a writer on the same store copies them
    on the server (``UploadPartCopy``), and they are fetched only to be checked and hashed."""

    __slots__ = (
        "copied",
        "copied_by",
        "crc",
        "dtype",
        "finished",
        "nbytes",
        "observers",
        "offset",
        "path",
        "record",
        "rel",
        "storage",
    )

    def __init__(
        self,
        path: str,
        offset: int,
        nbytes: int,
        dtype: str,
        crc: int | None = None,
        *,
        storage: Any = None,
        rel: str = "",
        record: record_checks.Record | None = None,
    ) -> None:
        self.path, self.offset, self.nbytes, self.dtype, self.crc = path, offset, nbytes, dtype, crc
        self.storage, self.rel = storage, rel
        self.record = record
        """The zip record this run is a part of, whose check sees the run's bytes as they pass
        (``record_checks``); ``None`` for a whole record (``crc``) or bytes without one."""
        self.observers: list[Observer] = []
        self.finished: list[Callable[[Run], object]] = []
        self.copied = 0
        """Bytes moved without passing through Python (0 when they all did)..."""
        self.copied_by = "upload_part_copy" if storage is not None else "copy_file_range"
        """...and how: ``copy_file_range``, ``upload_part_copy`` or
        ``WRITTEN_FROM_MAPPED_PAGES``."""

    def views(self) -> Iterator[memoryview]:
        """The run's bytes, a mapped window at a time (each released before the next); from an
        object store, fetched a window ahead."""
        if self.storage is not None:
            yield from _fetched(self)
            return
        with open(self.path, "rb") as f:
            self.check_size(f.fileno())
            yield from _mapped(f.fileno(), self.offset, self.nbytes, read_ahead=True)

    def check_size(self, fd: int) -> None:
        """Refuse a file that ends before the run does (mapped pages past the end of a file
        would kill the process with SIGBUS instead of raising)."""
        size = os.fstat(fd).st_size
        if self.offset + self.nbytes > size:
            raise CheckpointError(
                f"{self.path}: ends at byte {size}, before the {self.nbytes} bytes at "
                f"{self.offset} its index promises; the file is truncated"
            )

    def write_to(self, out: BinaryIO | Any, *see: Observer, record_seen: bool = False) -> None:
        """Append the run to ``out``, by a kernel copy when ``out`` offers one (``copy_range``)
        and both ends allow it, else by writing the mapped pages; ``see`` and the run's own
        observers get every byte, in order. ``record_seen``: the caller hands the run to the
        check of the record it is part of (``record_checks.saw_piece``), else it is seen here."""
        observers = [*see, *self.observers]
        check = _CrcCheck(self) if self.crc is not None else None
        if check is not None:
            observers.append(check)
        if self.record is not None and not record_seen:
            observers.append(_PartOfRecord(self, self.record))
        copy = getattr(out, "copy_range", None)
        copied = copy(self, observers) if copy is not None else None
        if copied is None:
            for view in self.views():
                feed(observers, view, out)
        else:
            self.copied = copied
        if check is not None:
            check.verify()
        for done in self.finished:
            done(self)


def copy_run(dst_fd: int, run: Run, observers: list[Observer]) -> bool:
    """Kernel-copy ``run`` to the current position of ``dst_fd`` and feed ``observers`` from
    mapped pages of the source meanwhile: the copy runs on a helper thread (the system call
    releases the GIL) while this thread hashes, so the two use both cores. False, with nothing
    written, when the kernel cannot copy between these two files (the caller writes the bytes
    instead)."""
    if run.storage is not None:  # an object: nothing for the kernel to copy from
        return False
    with open(run.path, "rb") as f:
        src = f.fileno()
        run.check_size(src)
        base = os.lseek(dst_fd, 0, os.SEEK_CUR)
        first = min(run.nbytes, PROBE)
        try:  # a first piece on this thread: a kernel that cannot copy says so here
            _copy(src, dst_fd, run.offset, base, first)
        except OSError:
            os.lseek(dst_fd, base, os.SEEK_SET)
            os.ftruncate(dst_fd, base)
            return False
        pieces = [
            (run.offset + done, base + done, min(WINDOW, run.nbytes - done))
            for done in range(first, run.nbytes, WINDOW)
        ]
        copies = [_copiers().submit(_copy, src, dst_fd, *piece) for piece in pieces]
        try:
            for view in _mapped(src, run.offset, run.nbytes):
                feed(observers, view)
        finally:
            for copy in copies:
                copy.result()
        os.lseek(dst_fd, base + run.nbytes, os.SEEK_SET)
    return True


PROBE = 1 << 20
"""Bytes copied before the rest is handed to the helper thread (a kernel that cannot copy between
the two files fails on these, and nothing else has been written)."""

_copier = threading.local()


def _copiers() -> ThreadPoolExecutor:
    """The calling thread's copier. One per writing thread: copies into one file take its
    inode's lock, so a second copier of the same file only spins on it (measured: the same
    speed for twice the CPU, which the hashing on the other core needs); a thread writing
    another file at the same time has its own. (A copier's thread ends once its writing
    thread has ended and nothing holds the pool.)"""
    pool = getattr(_copier, "pool", None)
    if pool is None:
        pool = _copier.pool = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-copy")
    return pool


def _copy(src: int, dst: int, src_offset: int, dst_offset: int, nbytes: int) -> None:
    """``nbytes`` from ``src_offset`` of ``src`` to ``dst_offset`` of ``dst``, in the kernel."""
    done = 0
    while done < nbytes:
        n = os.copy_file_range(src, dst, nbytes - done, src_offset + done, dst_offset + done)
        if n <= 0:
            raise OSError(f"copy_file_range copied nothing at byte {src_offset + done}")
        done += n


READ_AHEAD = 128 << 20
"""Bytes of a run that ``views`` asks the disk for ahead of the window it hands out
(``posix_fadvise(WILLNEED)``). Mapped pages otherwise come in as they fault, each fault
waiting for its read, and the thread writing them waits with it; asked ahead, the disk reads
while the thread writes (measured, DCP -> torch from a cold cache, 8 interleaved rounds:
2.81 -> 2.37 s median; warm, and for a reshard whose runs are a few MB, no change)."""


def _mapped(fd: int, offset: int, nbytes: int, *, read_ahead: bool = False) -> Iterator[memoryview]:
    start, end = offset, offset + nbytes
    asked = start  # bytes before this have been asked of the disk (``read_ahead``)
    while start < end:
        if read_ahead and asked < min(end, start + READ_AHEAD // 2):
            n = min(end, start + READ_AHEAD) - asked
            with contextlib.suppress(OSError, AttributeError):  # only a hint, where there is one
                os.posix_fadvise(fd, asked, n, os.POSIX_FADV_WILLNEED)
            asked += n
        base = start - start % mmap.ALLOCATIONGRANULARITY
        length = min(end, base + WINDOW) - base
        pages = mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=base)
        try:
            pages.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(pages)[start - base : length]
            try:
                yield view
            finally:
                view.release()
        finally:
            # A reader interrupted mid-run may still hold slices of the window (in its
            # traceback's frames): the pages are then unmapped when those go, not here.
            with contextlib.suppress(BufferError):
                pages.close()
        start = base + length


FETCH_WINDOW = 32 << 20
"""Bytes of an object fetched at a time for the checksums of a run copied on the server
(two windows are held: the one hashed, the one being fetched)."""


def _fetched(run: Run) -> Iterator[memoryview]:
    """The bytes of a run on an object store, window by window, the next fetched while the
    caller works on the current one; an object shorter than the run is refused by name."""
    windows = [
        (start, min(FETCH_WINDOW, run.offset + run.nbytes - start))
        for start in range(run.offset, run.offset + run.nbytes, FETCH_WINDOW)
    ]

    def fetch(window: tuple[int, int]) -> bytes:
        data = run.storage.read_range(run.rel, *window)
        if len(data) != window[1]:
            raise CheckpointError(
                f"{run.path}: ends before the {run.nbytes} bytes at {run.offset} its index "
                "promises; the object is truncated"
            )
        return data

    with ThreadPoolExecutor(1, thread_name_prefix="ckptctl-fetch") as ahead:
        pending = ahead.submit(fetch, windows[0]) if windows else None
        for i in range(len(windows)):
            assert pending is not None
            data = pending.result()
            pending = ahead.submit(fetch, windows[i + 1]) if i + 1 < len(windows) else None
            yield memoryview(data)


SLICE = 1 << 20
"""Bytes written, or shown to the observers, at a time. On Linux page-cache writes of tens of
MiB in one call run an order of magnitude slower than the same bytes in ~1 MiB calls (measured:
0.37 vs 5 GB/s); and a run's checksums (the file's and the tensor's xxh3, a CRC-32) pass over
a 1 MiB piece while it is still in the core's cache, where each taking a whole 64 MiB window
would read it from memory three times (measured: 8.6 against 15-17 ms per window)."""


def slices(data: bytes | memoryview) -> Iterator[memoryview]:
    """``data``'s bytes, ``SLICE`` at a time."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), SLICE):
        yield view[start : start + SLICE]


def write_in_slices(out: BinaryIO | Any, data: bytes | memoryview) -> None:
    """Write ``data`` to ``out`` ``SLICE`` at a time (see ``SLICE`` for why)."""
    for piece in slices(data):
        out.write(piece)


def feed(observers: list[Observer], data: memoryview, out: BinaryIO | Any = None) -> None:
    """Show ``data`` to every observer, in order, a slice at a time (all of them see one slice
    before the next is read), and write each slice to ``out``, if given, once they have."""
    if len(observers) == 1 and out is None:
        observers[0](data)
        return
    for piece in slices(data):
        for observe in observers:
            observe(piece)
        if out is not None:
            out.write(piece)


class _PartOfRecord:
    """Hands the run's bytes, as they pass, to the check of the zip record they are part of
    (``record_checks.saw``: checked in passing where the parts come in order)."""

    def __init__(self, run: Run, record: record_checks.Record) -> None:
        self.record = record
        self.at = run.offset - record.offset

    def __call__(self, view: memoryview) -> None:
        record_checks.saw(self.record, self.at, view)
        self.at += len(view)


class _CrcCheck:
    """The run's CRC-32 against the one its source records (a corrupt source is refused,
    as a whole-record read is)."""

    def __init__(self, run: Run) -> None:
        self.run, self.value = run, 0

    def __call__(self, view: memoryview) -> None:
        self.value = crc32(view, self.value)

    def verify(self) -> None:
        if self.value != self.run.crc:
            raise CheckpointError(
                f"{self.run.path}: the record at byte {self.run.offset} fails its CRC-32 check; "
                "the file is corrupt (ckptctl verify lists every damaged entry)"
            )
