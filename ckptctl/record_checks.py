"""CRC-32 checks of the zip records a job reads only part of.

A read that covers a whole storage record is checked against the CRC-32 its archive records
as the bytes pass. A reshard reads most records in parts (each new tensor-parallel rank takes
half the columns of every row, or a contiguous half), and no part can be checked alone, so a
corrupt byte there would be carried into the output, under new checksums that then vouch for
it. Here each such record is checked once: as its parts pass (their CRC-32s joined, in
whatever order they come: no second pass over the bytes), or, for a record the job does not
read to the last byte, whole, on a background thread (CRC-32 releases the GIL), from the
file's mapped pages a window at a time.
A writer calls ``settle`` with its source files before it marks a file finished (and a
training-loop load before it returns): it waits for the checks asked so far and raises the
first failure among those files, so a corrupt source never yields a file marked complete.
Failures are kept (a file unchanged since is not checked again, and a second job reading it
must fail too); reads outside a job (a reader used on its own) ask as well, and their
failures reach only a job that reads the same file.

Only local files are checked this way: on an object store the record's other bytes would have
to be fetched a second time. ``ckptctl verify`` checks every record of a source, wherever it is.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckptctl.crc import crc32, crc32_combine
from ckptctl.errors import CheckpointError

WINDOW = 64 << 20
"""Bytes of a record mapped at a time (a mapped page counts towards the process's resident
memory while it is mapped)."""


@dataclass(frozen=True)
class Record:
    """Bytes ``[offset, offset + nbytes)`` of local file ``path``, whose CRC-32 its archive
    records as ``crc``; ``name`` says which record it is in a failure's message."""

    path: str
    offset: int
    nbytes: int
    crc: int
    name: str


Key = tuple[int, int, int, int]
"""A record by (device, inode, modification time, offset): a file changed since is checked
again."""
_lock = threading.Condition()
_todo: deque[tuple[Key, Record]] = deque()
_pending = 0
_seen: set[Key] = set()
"""The records checked, or queued for the checking thread."""
_failures: dict[Key, str] = {}
"""The checks that failed, by record, with their messages, in the order they failed."""
_thread: threading.Thread | None = None


Piece = tuple[int, int, int]
"""Bytes ``[start, end)`` of a record that have passed, and their CRC-32."""
_parts: dict[Key, tuple[Record, list[Piece]]] = {}
"""Records read in parts so far: the pieces passed, apart, in order of their start."""


def _key(record: Record) -> Key | None:
    try:
        st = os.stat(record.path)
    except OSError:
        return None  # the read that led here has failed or will fail, naming the file
    return (st.st_dev, st.st_ino, st.st_mtime_ns, record.offset)


def ask(record: Record) -> None:
    """Check ``record`` whole, on the checking thread, unless it was checked or asked for."""
    key = _key(record)
    if key is not None:
        with _lock:
            _enqueue(key, record)


def saw(record: Record, start: int, data: Any) -> None:
    """A read passed bytes ``[start, start + len(data))`` of ``record``. Their CRC-32 is taken
    as they pass, for the bytes no earlier part held, and joined with the parts beside them
    (``crc32_combine``): once the parts cover the record it is checked, with no second pass
    over its bytes, whatever order its parts came in (a merge reads a shard band by band; a
    cut reads column halves, each touching the rows' other half)."""
    key = _key(record)
    if key is None:
        return
    view = memoryview(data).cast("B")
    with _lock:  # held across the CRC-32s of the part: parts of one record must not race
        if key in _seen:
            return
        _, pieces = _parts.get(key, (record, []))
        _finish_or_keep(key, record, _joined(_with_part(pieces, start, view)))


def saw_piece(record: Record, start: int, nbytes: int, value: int) -> None:
    """Like ``saw``, for a part whose CRC-32 the caller has already (a writer that computes the
    CRC-32 of the same bytes for its own output derives the part's from it): no pass at all.
    A part overlapping one seen before cannot be trimmed, and hands the record to the whole
    check."""
    key = _key(record)
    if key is None:
        return
    with _lock:
        if key in _seen:
            return
        _, pieces = _parts.get(key, (record, []))
        if any(lo < start + nbytes and start < hi for lo, hi, _ in pieces):
            _enqueue(key, record)
            return
        _finish_or_keep(key, record, _joined(sorted([*pieces, (start, start + nbytes, value)])))


def _finish_or_keep(key: Key, record: Record, pieces: list[Piece]) -> None:
    """Check ``record`` once its pieces cover it, else keep them (call under the lock)."""
    if len(pieces) != 1 or pieces[0][:2] != (0, record.nbytes):
        _parts[key] = (record, pieces)
        return
    _parts.pop(key, None)
    _seen.add(key)
    if pieces[0][2] != record.crc:
        _failures[key] = _failure(record)


def _with_part(pieces: list[Piece], start: int, view: memoryview) -> list[Piece]:
    """``pieces`` and the bytes of ``view`` (from ``start``) that none of them holds."""
    end, at, new = start + len(view), start, []
    for lo, hi, _ in pieces:
        if hi <= at or lo >= end:
            continue
        if lo > at:
            new.append((at, lo, crc32(view[at - start : lo - start])))
        at = max(at, hi)
    if at < end:
        new.append((at, end, crc32(view[at - start :])))
    return sorted(pieces + new)


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Pieces that meet made one."""
    out: list[Piece] = []
    for lo, hi, value in pieces:
        if out and out[-1][1] == lo:
            first, _, before = out[-1]
            out[-1] = (first, hi, crc32_combine(before, value, hi - lo))
        else:
            out.append((lo, hi, value))
    return out


def _enqueue(key: Key, record: Record) -> None:
    """Queue the whole check of ``record`` (call under the lock)."""
    global _pending, _thread
    _parts.pop(key, None)
    if key in _seen:
        return
    _seen.add(key)
    _todo.append((key, record))
    _pending += 1
    if _thread is None:
        _thread = threading.Thread(target=_check_all, daemon=True, name="ckptctl-crc")
        _thread.start()
    _lock.notify_all()


def settle(paths: Iterable[str]) -> None:
    """Wait for every check asked so far; raise the first that failed in one of ``paths``."""
    files = set()
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            files.add((st.st_dev, st.st_ino, st.st_mtime_ns))
    with _lock:
        for key, (record, _) in list(_parts.items()):
            if key[:3] in files:  # not every byte was read (rows past a vocabulary cut)
                _enqueue(key, record)
        _lock.wait_for(lambda: _pending == 0)
        failures = [text for key, text in _failures.items() if key[:3] in files]
    if failures:
        raise CheckpointError(failures[0])


def _forget_in_child() -> None:
    """A forked child has no checking thread (and may have copied the lock held): it starts
    afresh, or its first ``settle`` would wait for a thread that is not there."""
    global _lock, _pending, _thread
    _lock, _pending, _thread = threading.Condition(), 0, None
    _todo.clear()
    _parts.clear()
    _seen.clear()
    _failures.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _check_all() -> None:
    global _pending
    while True:
        with _lock:
            _lock.wait_for(lambda: bool(_todo))
            key, record = _todo.popleft()
        try:
            failure = _check(record)
        except Exception as err:  # any: the thread must count every record done, or settle waits
            failure = f"{record.name}: cannot be read to check its CRC-32 ({err})"
        with _lock:
            if failure is not None:
                _failures[key] = failure
            _pending -= 1
            _lock.notify_all()


def _check(record: Record) -> str | None:
    with open(record.path, "rb") as f:
        fd = f.fileno()
        if os.fstat(fd).st_size < record.offset + record.nbytes:
            return f"{record.name}: the file ends inside the record; it is truncated"
        value = _crc_of(fd, record.offset, record.nbytes)
    return _failure(record) if value != record.crc else None


def _failure(record: Record) -> str:
    return (
        f"{record.name} fails its CRC-32 check; the file is corrupt (ckptctl verify lists every "
        "damaged entry)"
    )


def _crc_of(fd: int, offset: int, nbytes: int) -> int:
    value, start, end = 0, offset, offset + nbytes
    while start < end:
        base = start - start % mmap.ALLOCATIONGRANULARITY
        length = min(end, base + WINDOW) - base
        with mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=base) as pages:
            with contextlib.suppress(OSError, AttributeError):
                pages.madvise(mmap.MADV_SEQUENTIAL)
            with memoryview(pages)[start - base : length] as view:
                value = crc32(view, value)
        start = base + length
    return value
