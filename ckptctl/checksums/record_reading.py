"""A zip record (or a safetensors tensor) whose bytes a job reads, and how it is checked by
reading it: its CRC-32 from the parts that passed and the bytes between them, or its xxh3-64
whole. ``record_checks`` decides when; this module reads and compares."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from ckptctl.checksums.crc import crc32, crc32_combine

if TYPE_CHECKING:
    from ckptctl.checksums.record_checks import RecordChecks

WINDOW = 64 << 20
"""Bytes of a record mapped at a time (a mapped page counts towards the process's resident
memory while it is mapped)."""

Piece = tuple[int, int, int]
"""Bytes ``[start, end)`` of a record that have passed, and their CRC-32."""


@dataclass(frozen=True)
class Record:
    """Bytes ``[offset, offset + nbytes)`` of file ``path``, whose CRC-32 its archive records
    as ``crc``; ``name`` says which record it is in a failure's message. ``fetch(start,
    nbytes)``, for an object in a store (``path`` its URL, ``version`` what its store says of
    its content), reads bytes of the record by position in it; ``None`` for a local file."""

    path: str
    offset: int
    nbytes: int
    crc: int
    name: str
    fetch: Callable[[int, int], bytes] | None = field(default=None, compare=False)
    version: str = ""
    digest: str | None = None
    """Instead of a CRC-32, the xxh3-64 a ckptctl manifest records for exactly these bytes (a
    safetensors tensor, whose format stores no checksum). Its parts cannot be joined out of
    order: parts read from the start, in order, are hashed as they pass; otherwise the record
    is read whole by the checking thread."""
    checks: RecordChecks | None = field(default=None, compare=False, repr=False)
    """The checks that see this record's parts (those of the storage it was read from)."""


def joined(pieces: list[Piece]) -> list[Piece]:
    """Pieces that meet made one."""
    out: list[Piece] = []
    for lo, hi, value in pieces:
        if out and out[-1][1] == lo:
            first, _, before = out[-1]
            out[-1] = (first, hi, crc32_combine(before, value, hi - lo))
        else:
            out.append((lo, hi, value))
    return out


def check(record: Record, pieces: list[Piece]) -> str | None:
    """The record's CRC-32 from the pieces seen and the bytes between them, read now (a
    record checked by its xxh3: all its bytes, read now)."""
    if record.digest is not None:
        return _check_digest(record)
    between, at = [], 0
    for lo, hi, _ in [*pieces, (record.nbytes, record.nbytes, 0)]:
        if lo > at:
            between.append((at, lo))
        at = max(at, hi)
    if record.fetch is not None:
        gaps = [(lo, hi, _fetched_crc(record.fetch, lo, hi)) for lo, hi in between]
    elif between:
        with open(record.path, "rb") as f:
            fd = f.fileno()
            if os.fstat(fd).st_size < record.offset + record.nbytes:
                return f"{record.name}: the file ends inside the record; it is truncated"
            gaps = [(lo, hi, _crc_of(fd, record.offset + lo, hi - lo)) for lo, hi in between]
    else:
        gaps = []
    value = next((crc for _, _, crc in joined(sorted(pieces + gaps))), 0)
    return failure(record) if value != record.crc else None


def _check_digest(record: Record) -> str | None:
    hasher = xxhash.xxh3_64()
    if record.fetch is not None:
        for at in range(0, record.nbytes, WINDOW):
            data = record.fetch(at, min(WINDOW, record.nbytes - at))
            if len(data) != min(WINDOW, record.nbytes - at):
                raise OSError("the object ends inside the record; it is truncated")
            hasher.update(data)
    else:
        with open(record.path, "rb") as f:
            fd = f.fileno()
            if os.fstat(fd).st_size < record.offset + record.nbytes:
                return f"{record.name}: the file ends inside the record; it is truncated"
            _over_pages(fd, record.offset, record.nbytes, hasher.update)
    return failure(record) if hasher.hexdigest() != record.digest else None


def _fetched_crc(fetch: Callable[[int, int], bytes], start: int, end: int) -> int:
    value = 0
    for at in range(start, end, WINDOW):
        data = fetch(at, min(WINDOW, end - at))
        if len(data) != min(WINDOW, end - at):
            raise OSError("the object ends inside the record; it is truncated")
        value = crc32(data, value)
    return value


def failure(record: Record) -> str:
    if record.digest is not None:
        return (
            f"{record.name} differs from the checksum its ckptctl manifest records; the file "
            "changed after it was written (ckptctl verify lists every damaged file)"
        )
    return (
        f"{record.name} fails its CRC-32 check; the file is corrupt (ckptctl verify lists every "
        "damaged entry)"
    )


def _crc_of(fd: int, offset: int, nbytes: int) -> int:
    value = [0]

    def update(view: memoryview) -> None:
        value[0] = crc32(view, value[0])

    _over_pages(fd, offset, nbytes, update)
    return value[0]


def _over_pages(fd: int, offset: int, nbytes: int, see: Callable[[memoryview], object]) -> None:
    """Hand bytes ``[offset, offset + nbytes)`` of file ``fd`` to ``see``, a mapped window at a
    time."""
    start, end = offset, offset + nbytes
    while start < end:
        base = start - start % mmap.ALLOCATIONGRANULARITY
        length = min(end, base + WINDOW) - base
        with mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=base) as pages:
            with contextlib.suppress(OSError, AttributeError):
                pages.madvise(mmap.MADV_SEQUENTIAL)
            with memoryview(pages)[start - base : length] as view:
                see(view)
        start = base + length
