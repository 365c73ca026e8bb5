"""CRC-32 checks of the zip records a job reads only part of.

A read that covers a whole storage record is checked against the CRC-32 its archive records
as the bytes pass. A reshard reads most records in parts (each new tensor-parallel rank takes
half the columns of every row, or a contiguous half), and no part can be checked alone, so a
corrupt byte there would be carried into the output, under new checksums that then vouch for
it. Here each such record is checked once: as its parts pass (their CRC-32s joined, in
whatever order they come: no second pass over the bytes), or, for a record the job does not
read to the last byte, by reading the bytes no part held, on a background thread (CRC-32
releases the GIL): from the file's mapped pages a window at a time, or by ranged reads of an
object.
A writer calls ``settle`` with its source files before it marks a file finished: it waits
for the checks asked so far and raises the first failure among those files, so a corrupt
source never yields a file marked complete. The ranks of a training-loop load call
``settle_across`` before it returns: each rank reads only its share of a record, so their
parts are pooled to check it.
The files written beside it usually read the rest of the records it read in part (the other
half of each row), so a writer leaves those (``leave_parts``) and marks the file once they
are ``checked``, or reads what no file did (``check_now``) after a few more files.
The checks are an object (``RecordChecks``) that each opened storage owns, and every record a
reader of that storage hands out points to it: state lives as long as the job that opened the
storage (a training process loading checkpoint after checkpoint keeps none of the earlier
loads' records), and two jobs in one process never share it. Failures are kept for the job
(a record is checked once, and every file reading it fails).

Records of objects in a store are checked the same way; the bytes a job never reads are
fetched for it (a vocabulary cut leaves a few rows; a job reads the rest of every record it
touches). ``ckptctl verify`` checks every record of a source, wherever it is.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

from ckptctl.checksums.crc import crc32
from ckptctl.checksums.record_reading import Piece, Record, check, failure, joined
from ckptctl.errors import CheckpointError

__all__ = ["Record", "RecordChecks", "ask", "saw", "saw_piece"]

FileKey = tuple[Any, ...]
"""A file as it is now: (device, inode, modification time) of a local file, so that a file
changed since is checked again; (URL, version) of an object."""
Key = tuple[FileKey, int]
"""A record: its file and its offset there."""

Identity = tuple[str, str, int, int, int, str | None]
"""A record as every rank names it: path or URL, version, offset, size, CRC-32 or xxh3 (a local
file's device and inode are not comparable across nodes)."""


def _checks_of(record: Record) -> RecordChecks:
    """The checks ``record`` belongs to (``RecordChecks.record`` makes every record the
    pipeline hands on): a record without them would go unchecked, so it is refused."""
    if record.checks is None:
        raise ValueError(f"{record.name}: a record made outside RecordChecks.record")
    return record.checks


def ask(record: Record) -> None:
    """Check ``record`` whole (by the checks it belongs to), unless checked or asked for."""
    _checks_of(record).ask(record)


def saw(record: Record, start: int, data: Any) -> None:
    """A read passed bytes ``[start, start + len(data))`` of ``record`` (``RecordChecks.saw``)."""
    _checks_of(record).saw(record, start, data)


def saw_piece(record: Record, start: int, nbytes: int, value: int) -> None:
    """A part of ``record`` whose CRC-32 the caller has (``RecordChecks.saw_piece``)."""
    _checks_of(record).saw_piece(record, start, nbytes, value)


def failure_text(record: Record) -> str:
    """How a failed check of ``record`` is reported."""
    return failure(record)


class RecordChecks:
    """The checks of the records read from one storage: parts seen, records checked or
    queued, failures, and the thread that reads what no part held (started when there is work,
    ended when there is none). After a fork the child starts afresh: it has no checking thread
    and may have copied the lock held."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Condition()  # re-entrant: settle calls check_now holding it
        self._todo: deque[tuple[Key, Record, list[Piece]]] = deque()
        self._pending = 0
        self._seen: set[Key] = set()
        """The records checked, or queued for the checking thread."""
        self._failures: dict[Key, str] = {}
        """The checks that failed, by record, with their messages, in the order they failed."""
        self._thread: threading.Thread | None = None
        self._read_again = [0, 0]
        """Records the checks have read bytes of themselves (bytes no read of the job passed),
        and those bytes."""
        self._parts: dict[Key, tuple[Record, list[Any]]] = {}
        """Records read in parts so far: the pieces passed, apart, in order of their start
        (``Piece`` CRC-32 parts; for a record checked by its xxh3, one ``(0, end, running
        hasher)``)."""
        self._versions: dict[str, str] = {}
        """The version of each object last read, by URL: what ``settle`` holds objects to."""

    @property
    def lock(self) -> threading.Condition:
        if os.getpid() != self._pid:  # a forked child
            self._reset()
        return self._lock

    def record(self, *args: Any, **kwargs: Any) -> Record:
        """A ``Record`` whose parts these checks see."""
        kwargs["checks"] = self
        return Record(*args, **kwargs)

    def _key(self, record: Record) -> Key | None:
        if record.fetch is not None:
            self._versions[record.path] = record.version
            return (record.path, record.version), record.offset
        try:
            st = os.stat(record.path)
        except OSError:
            return None  # the read that led here has failed or will fail, naming the file
        return (st.st_dev, st.st_ino, st.st_mtime_ns), record.offset

    def ask(self, record: Record) -> None:
        """Check ``record`` whole, on the checking thread, unless it was checked or asked for."""
        key = self._key(record)
        if key is not None:
            with self.lock:
                self._enqueue(key, record, [])

    def saw(self, record: Record, start: int, data: Any) -> None:
        """A read passed bytes ``[start, start + len(data))`` of ``record``. Their CRC-32 is
        taken as they pass, for the bytes no earlier part held, and joined with the parts
        beside them (``crc32_combine``): once the parts cover the record it is checked, with no
        second pass over its bytes, whatever order its parts came in (a merge reads a shard
        band by band; a cut reads column halves, each touching the rows' other half)."""
        key = self._key(record)
        if key is None:
            return
        view = memoryview(data).cast("B")
        if record.digest is not None:
            self._saw_hashed(key, record, start, view)
            return
        with self.lock:  # held across the CRC-32s of the part: parts must not race
            if key in self._seen:
                return
            _, pieces = self._parts.get(key, (record, []))
            self._finish_or_keep(key, record, joined(_with_part(pieces, start, view)))

    def saw_piece(self, record: Record, start: int, nbytes: int, value: int) -> None:
        """Like ``saw``, for a part whose CRC-32 the caller has already (a writer that computes
        the CRC-32 of the same bytes for its own output derives the part's from it): no pass
        at all. A part overlapping one seen before cannot be trimmed: the record is checked
        from the parts seen before and the bytes none of them holds."""
        key = self._key(record)
        if key is None:
            return
        if record.digest is not None:  # a CRC-32 says nothing of an xxh3: read it whole
            with self.lock:
                self._enqueue(key, record, [])
            return
        with self.lock:
            if key in self._seen:
                return
            _, pieces = self._parts.get(key, (record, []))
            if any(lo < start + nbytes and start < hi for lo, hi, _ in pieces):
                self._enqueue(key, record, pieces)  # the bytes no piece holds are read
                return
            whole = joined(sorted([*pieces, (start, start + nbytes, value)]))
            self._finish_or_keep(key, record, whole)

    def _saw_hashed(self, key: Key, record: Record, start: int, view: memoryview) -> None:
        """A part of a record checked by its xxh3: hashed on if it follows the parts before it
        from the record's start, else the record is queued to be read whole."""
        with self.lock:
            if key in self._seen:
                return
            _, pieces = self._parts.get(key, (record, [(0, 0, xxhash.xxh3_64())]))
            ((_, at, hasher),) = pieces
            assert isinstance(hasher, xxhash.xxh3_64)
            if start != at:
                self._enqueue(key, record, [])
                return
            hasher.update(view)
            at += len(view)
            if at < record.nbytes:
                self._parts[key] = (record, [(0, at, hasher)])
                return
            self._parts.pop(key, None)
            self._seen.add(key)
            if hasher.hexdigest() != record.digest:
                self._failures[key] = failure(record)

    def _finish_or_keep(self, key: Key, record: Record, pieces: list[Piece]) -> None:
        """Check ``record`` once its pieces cover it, else keep them (call under the lock)."""
        if len(pieces) != 1 or pieces[0][:2] != (0, record.nbytes):
            self._parts[key] = (record, pieces)
            return
        self._parts.pop(key, None)
        self._seen.add(key)
        if pieces[0][2] != record.crc:
            self._failures[key] = failure(record)

    def _enqueue(self, key: Key, record: Record, pieces: list[Piece]) -> None:
        """Queue the check of ``record`` from ``pieces`` and the bytes they do not hold (call
        under the lock)."""
        self._parts.pop(key, None)
        if key in self._seen:
            return
        self._seen.add(key)
        self._todo.append((key, record, pieces))
        self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._check_all, daemon=True, name="ckptctl-crc")
            self._thread.start()
        self._lock.notify_all()

    def settle(self, paths: Iterable[str], *, leave_parts: bool = False) -> set[Key]:
        """Wait for every check asked so far; raise the first that failed in one of ``paths``
        (local paths, or URLs of objects). A record read only in part is checked with the bytes
        no read passed, read now; with ``leave_parts``, such records are left for the job's
        other files to read on (reading their bytes now would read them twice) and returned:
        ``checked`` says when they are done, ``check_now`` reads what no file did."""
        files = self._file_keys(paths)
        with self.lock:
            waiting = {key for key in self._parts if key[0] in files}
            if not leave_parts:
                self.check_now(waiting)
                waiting = set()
            self._lock.wait_for(lambda: self._pending == 0)
            failures = [text for key, text in self._failures.items() if key[0] in files]
        if failures:
            raise CheckpointError(failures[0])
        return waiting

    def _file_keys(self, paths: Iterable[str]) -> set[FileKey]:
        files: set[FileKey] = set()
        for path in paths:
            if "://" in path:
                if path in self._versions:
                    files.add((path, self._versions[path]))
                continue
            with contextlib.suppress(OSError):
                st = os.stat(path)
                files.add((st.st_dev, st.st_ino, st.st_mtime_ns))
        return files

    def settle_across(
        self,
        paths: Iterable[str],
        gather: Callable[[Any], list[Any]],
        rank: int,
        failure: str | None = None,
    ) -> list[str | None]:
        """``settle`` for ranks that each read parts of the same records (a load on another
        number of ranks: each reads the rows of its box). Every rank calls it; ``gather(obj)``
        returns every rank's ``obj`` in rank order. The ranks' parts are pooled, so a record is
        checked from the CRC-32s of the parts all ranks read, and the bytes no rank read are
        read (or fetched) by one rank that holds the record, not by each: a rank never reads
        another's share. ``failure`` is this rank's own (a load that failed before its checks),
        shared so that no rank waits for it. Returns every rank's first failure, in rank
        order."""
        files = self._file_keys(paths)
        with self.lock:
            self._lock.wait_for(lambda: self._pending == 0)
            if failure is None:
                failure = next(
                    (text for key, text in self._failures.items() if key[0] in files), None
                )
            parts = self._parts
            mine = {key: parts.pop(key) for key in [key for key in parts if key[0] in files]}
            # A hash in progress cannot be pooled with other ranks' parts: its record is read
            # whole by its checking rank.
            mine = {k: (r, [] if r.digest is not None else p) for k, (r, p) in mine.items()}
            self._seen.update(mine)
        everyone = gather((failure, [(_identity(r), pieces) for r, pieces in mine.values()]))
        failures = [text for text, _ in everyone]
        if any(failures):  # the load fails on every rank; its records are left to a later read
            with self.lock:
                self._seen.difference_update(mine)
            return failures
        return gather(self._check_pooled(mine, [shared for _, shared in everyone], rank))

    def _check_pooled(
        self,
        mine: dict[Key, tuple[Record, list[Piece]]],
        everyone: list[list[tuple[Identity, list[Piece]]]],
        rank: int,
    ) -> str | None:
        """Check the pooled records this rank is to check (one holder of each, spread by a
        hash of the record); the first failure."""
        pooled: dict[Identity, tuple[list[int], list[Piece]]] = {}
        for holder, shared in enumerate(everyone):
            for identity, pieces in shared:
                holders, parts = pooled.setdefault(identity, ([], []))
                holders.append(holder)
                parts += pieces
        own = {_identity(record): (key, record) for key, (record, _) in mine.items()}
        first = None
        for identity, (holders, parts) in sorted(pooled.items()):
            if holders[zlib.crc32(repr(identity).encode()) % len(holders)] != rank:
                continue
            key, record = own[identity]
            failed = self._run_check(key, record, _disjoint(parts))
            first = first or failed
        return first

    def describe(self, keys: Iterable[Key]) -> list[dict[str, Any]] | None:
        """The records of ``keys`` still unchecked, as plain values a later process can check
        (``from_description``); ``None`` when one is an object in a store (its reader is
        needed to fetch it) or already failed."""
        out = []
        with self.lock:
            for key in keys:
                if key in self._failures:
                    return None
                if key not in self._parts:
                    continue
                record = self._parts[key][0]
                if record.fetch is not None:
                    return None
                out.append(
                    {
                        "path": record.path,
                        "offset": record.offset,
                        "nbytes": record.nbytes,
                        "crc": record.crc,
                        "name": record.name,
                        "digest": record.digest,
                    }
                )
        return out

    def from_description(self, described: dict[str, Any]) -> Record:
        return self.record(**described)

    def key_of(self, record: Record) -> Key | None:
        """How ``settle`` and ``checked`` name ``record`` (``None``: its file is gone)."""
        return self._key(record)

    def checked(self, keys: Iterable[Key]) -> bool:
        """Whether every record of ``keys`` (from ``settle``) has been checked since; raises
        the first that failed."""
        with self.lock:
            if any(key in self._parts for key in keys):
                return False
            self._lock.wait_for(lambda: self._pending == 0)
            failures = [self._failures[key] for key in keys if key in self._failures]
        if failures:
            raise CheckpointError(failures[0])
        return True

    def check_now(self, keys: Iterable[Key]) -> None:
        """Check the records of ``keys`` still read only in part with the bytes no read
        passed, read now (and ``checked`` then waits for it)."""
        with self.lock:
            for key in keys:
                if key in self._parts:
                    record, pieces = self._parts[key]
                    self._enqueue(key, record, pieces)

    def read_again(self) -> tuple[int, int]:
        """Records whose bytes the checks read (or fetched) themselves so far, and how many
        bytes: a job reports what its checks cost."""
        with self.lock:
            return self._read_again[0], self._read_again[1]

    def _check_all(self) -> None:
        """The checking thread: runs the queued checks, and ends once none is left (the next
        one queued starts another)."""
        while True:
            with self._lock:
                if not self._todo:
                    self._thread = None
                    return
                key, record, pieces = self._todo.popleft()
            self._run_check(key, record, pieces)
            with self._lock:
                self._pending -= 1
                self._lock.notify_all()

    def _run_check(self, key: Key, record: Record, pieces: list[Piece]) -> str | None:
        """``check``, its failure kept and the bytes it read counted; the failure."""
        try:
            failed = check(record, pieces)
        except Exception as err:  # any: a failure to check is a failure, named (and counted)
            failed = f"{record.name}: cannot be read to check it ({err})"
        again = record.nbytes
        if record.digest is None:
            again -= sum(hi - lo for lo, hi, _ in pieces)
        with self._lock:
            if failed is not None:
                self._failures[key] = failed
            self._read_again[0] += again > 0
            self._read_again[1] += again
        return failed


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


def _identity(record: Record) -> Identity:
    return record.path, record.version, record.offset, record.nbytes, record.crc, record.digest


def _disjoint(pieces: list[Piece]) -> list[Piece]:
    """Pieces that do not overlap, in order: ranks that read the same bytes (replicas) give
    the same piece twice, which counts once; a piece overlapping a kept one is dropped (its
    bytes beyond are then read for the check)."""
    out: list[Piece] = []
    for piece in sorted(pieces, key=lambda p: (p[0], -p[1])):
        if not out or piece[0] >= out[-1][1]:
            out.append(piece)
    return out
