"""Whole-record CRC-32 checks of records read in parts (ckptctl/checksums/record_checks.py),
judged by zlib's CRC-32 of the bytes on disk."""

from __future__ import annotations

import os
import signal
import zlib
from pathlib import Path

import pytest

from ckptctl.checksums import record_checks, record_reading
from ckptctl.errors import CheckpointError

CHECKS = record_checks.RecordChecks()
"""The checks of the test running (a job's own: ``fresh_checks`` makes them per test)."""


@pytest.fixture(autouse=True)
def fresh_checks() -> None:
    global CHECKS
    CHECKS = record_checks.RecordChecks()


def _record(path: Path, payload: bytes, at: int = 100) -> record_checks.Record:
    path.write_bytes(b"h" * at + payload + b"t" * 50)
    return CHECKS.record(str(path), at, len(payload), zlib.crc32(payload), f"{path}: r")


@pytest.fixture
def rereads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[record_checks.Record, int]]:
    """The records the checking thread checks by reading bytes no part held, in order, with
    how many bytes it reads (each still checked)."""
    checked: list[tuple[record_checks.Record, int]] = []
    real = record_checks.check

    def spy(record: record_checks.Record, pieces: list) -> str | None:
        checked.append((record, record.nbytes - sum(hi - lo for lo, hi, _ in pieces)))
        return real(record, pieces)

    monkeypatch.setattr(record_checks, "check", spy)
    return checked


def test_an_intact_record_passes_and_a_corrupt_one_fails_only_its_own_files(
    tmp_path: Path,
) -> None:
    payload = os.urandom(3 << 20)
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    record_checks.ask(_record(good, payload))
    corrupt = _record(bad, payload)
    raw = bytearray(bad.read_bytes())
    raw[corrupt.offset + len(payload) // 2] ^= 0x04
    bad.write_bytes(bytes(raw))
    record_checks.ask(corrupt)
    CHECKS.settle([str(good)])  # another file's failure is not this job's
    with pytest.raises(CheckpointError, match=r"bad\.pt: r fails its CRC-32 check"):
        CHECKS.settle([str(bad), str(good)])
    # kept: a second job on the unchanged file fails too, without checking it again
    record_checks.ask(corrupt)
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        CHECKS.settle([str(bad)])
    # a file written since is checked afresh
    _record(bad, payload)
    os.utime(bad, ns=(1, 1))
    record_checks.ask(corrupt)
    CHECKS.settle([str(bad)])


def test_a_record_past_the_end_of_its_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.pt"
    record = _record(path, b"x" * 1000)
    with open(path, "r+b") as f:
        f.truncate(record.offset + 10)
    record_checks.ask(record)
    with pytest.raises(CheckpointError, match="ends inside the record"):
        CHECKS.settle([str(path)])


def test_a_record_larger_than_a_window_is_checked_across_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(record_reading, "WINDOW", 1 << 16)
    payload = os.urandom((1 << 18) + 12345)
    path = tmp_path / "long.pt"
    record = _record(path, payload, at=70000)  # starts inside a window, not at its start
    with path.open("rb") as f:
        assert record_reading._crc_of(f.fileno(), record.offset, record.nbytes) == record.crc


def test_parts_read_in_order_are_checked_as_they_pass_without_a_second_read(
    tmp_path: Path, rereads: list[tuple[record_checks.Record, int]]
) -> None:
    payload = os.urandom(1 << 20)
    path = tmp_path / "bands.pt"
    record = _record(path, payload)
    for start in range(0, len(payload), 300_000):  # bands; the last one overlaps the one before
        lo = max(0, start - 1000)
        record_checks.saw(record, lo, payload[lo : start + 300_000])
    CHECKS.settle([str(path)])
    assert rereads == []
    # the same record corrupt, read in order: fails with no whole check either
    raw = bytearray(path.read_bytes())
    raw[record.offset + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(2, 2))
    corrupt = raw[record.offset : record.offset + record.nbytes]
    for start in range(0, len(payload), 300_000):
        record_checks.saw(record, start, corrupt[start : start + 300_000])
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        CHECKS.settle([str(path)])
    assert rereads == []


def test_parts_in_any_order_overlapping_are_joined_without_a_second_read(
    tmp_path: Path, rereads: list[tuple[record_checks.Record, int]]
) -> None:
    """Column halves of a row-major record, read band by band by two files: each part is the
    bytes from its first element to its last, so each overlaps the other half's."""
    rows, width = 64, 4096
    payload = os.urandom(rows * width)
    path = tmp_path / "halves.pt"
    record = _record(path, payload)
    parts = []
    for lo in range(0, rows, 16):
        hi = lo + 16
        parts.append((lo * width, (hi - 1) * width + width // 2))  # left half of rows lo..hi
        parts.append((lo * width + width // 2, hi * width))  # right half
    for start, end in reversed(parts):  # the last band of the right half first
        record_checks.saw(record, start, payload[start:end])
    CHECKS.settle([str(path)])
    assert rereads == []


@pytest.mark.parametrize("order", ["gap", "unfinished"])
def test_parts_that_do_not_cover_the_record_are_checked_with_the_bytes_between(
    tmp_path: Path, rereads: list[tuple[record_checks.Record, int]], order: str
) -> None:
    payload = os.urandom(1 << 20)
    path = tmp_path / f"{order}.pt"
    record = _record(path, payload)
    raw = bytearray(path.read_bytes())
    raw[record.offset + len(payload) - 3] ^= 0x80  # in bytes no read passes
    path.write_bytes(bytes(raw))
    if order == "gap":  # the second half but its last bytes, then the first half
        record_checks.saw(record, len(payload) // 2, payload[len(payload) // 2 : -10])
        record_checks.saw(record, 0, payload[: len(payload) // 2])
    else:  # the first half only (rows past a new vocabulary size are not read)
        record_checks.saw(record, 0, payload[: len(payload) // 2])
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        CHECKS.settle([str(path)])
    # only the bytes no read passed are read again
    assert rereads == [(record, 10 if order == "gap" else len(payload) // 2)]


def test_crc32_combine_joins_as_zlib_computes_the_whole() -> None:
    from ckptctl.checksums.crc import crc32_combine, crc32_combine_python

    for n1, n2 in [(0, 5), (5, 0), (1, 1), (1000, 3), (7, 123457), (0, 0)]:
        a, b = os.urandom(n1), os.urandom(n2)
        for combine in (crc32_combine, crc32_combine_python):
            assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_parts_whose_crc_the_writer_has_need_no_pass_and_overlaps_fall_back(
    tmp_path: Path, rereads: list[tuple[record_checks.Record, int]]
) -> None:
    payload = os.urandom(1 << 20)
    path = tmp_path / "runs.pt"
    record = _record(path, payload)
    half = len(payload) // 2
    record_checks.saw_piece(record, half, half, zlib.crc32(payload[half:]))
    record_checks.saw(record, 0, payload[: half + 100])  # a band reaching into the run
    CHECKS.settle([str(path)])
    assert rereads == []
    # a wrong CRC-32 for a part (the bytes changed under the writer) fails the record
    os.utime(path, ns=(3, 3))
    record_checks.saw_piece(record, 0, half, zlib.crc32(payload[:half]) ^ 1)
    record_checks.saw_piece(record, half, half, zlib.crc32(payload[half:]))
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        CHECKS.settle([str(path)])
    # parts that overlap cannot be joined: the record is checked from the first and the
    # bytes past it, read again (and is intact)
    os.utime(path, ns=(4, 4))
    record_checks.saw_piece(record, 0, half + 8, zlib.crc32(payload[: half + 8]))
    record_checks.saw_piece(record, half, half, zlib.crc32(payload[half:]))
    CHECKS.settle([str(path)])
    assert rereads == [(record, half - 8)]


def test_a_forked_child_checks_records_with_its_own_thread(tmp_path: Path) -> None:
    payload = os.urandom(1 << 16)
    path = tmp_path / "fork.pt"
    record = _record(path, payload)
    record_checks.ask(record)  # the parent's checking thread is running
    CHECKS.settle([str(path)])
    pid = os.fork()
    if pid == 0:  # the child: a whole check must finish, not wait for the parent's thread
        signal.alarm(20)  # a wait that never ends kills the child instead
        os.utime(path, ns=(5, 5))
        record_checks.ask(record)
        CHECKS.settle([str(path)])
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_records_of_objects_fetch_only_the_bytes_no_read_passed(
    rereads: list[tuple[record_checks.Record, int]],
) -> None:
    """An object in a store (no local file): its record is known by URL and version, and the
    bytes the job did not read are fetched by range for the check."""
    payload = os.urandom(1 << 20)
    fetched: list[tuple[int, int]] = []
    stored = {"v1": payload, "v2": payload[:-5] + bytes([payload[-5] ^ 1]) + payload[-4:]}

    def record(version: str) -> record_checks.Record:
        def fetch(at: int, nbytes: int) -> bytes:
            fetched.append((at, nbytes))
            return stored[version][at : at + nbytes]

        name = f"s3://b/ck/x.pt ({version}): r"
        crc = zlib.crc32(payload)
        return CHECKS.record("s3://b/ck/x.pt", 4096, len(payload), crc, name, fetch, version)

    half = len(payload) // 2
    record_checks.saw(record("v1"), 0, payload[:half])
    CHECKS.settle(["s3://b/other.pt"])  # another object's job leaves it be
    assert rereads == []
    CHECKS.settle(["s3://b/ck/x.pt"])
    assert fetched == [(half, half)] and [n for _, n in rereads] == [half]
    # the same URL at another version is another object: its corrupt tail is fetched and fails
    record_checks.saw(record("v2"), 0, payload[:half])
    with pytest.raises(CheckpointError, match=r"\(v2\): r fails its CRC-32 check"):
        CHECKS.settle(["s3://b/ck/x.pt"])
    # mended (the first version again): a job reading it now is not failed by the old one
    record_checks.saw(record("v1"), half, payload[half:])
    CHECKS.settle(["s3://b/ck/x.pt"])


def _rank(rank: int, world: int, record: record_checks.Record, parts: list, boxes: list) -> None:
    """One rank of a load: it reads its part of the record from the file, then the ranks
    check together over ``boxes`` (one queue per rank, every message tagged with its round)."""
    import contextlib

    rounds = iter(range(10))
    early: dict[int, list] = {}

    def gather(obj: object) -> list:
        n = next(rounds)
        for box in boxes[:world]:
            box.put((n, rank, obj))
        got = early.pop(n, [])
        while len(got) < world:
            m, sender, value = boxes[rank].get(timeout=60)
            if m == n:
                got.append((sender, value))
            else:
                early.setdefault(m, []).append((sender, value))
        return [value for _, value in sorted(got, key=lambda sv: sv[0])]

    start, end, failure = parts[rank]
    with open(record.path, "rb") as f:
        f.seek(record.offset + start)
        record_checks.saw(record, start, f.read(end - start))
    out: object
    with contextlib.suppress(Exception):
        out = "crashed"
        assert record.checks is not None
        failures = record.checks.settle_across([record.path], gather, rank, failure)
        out = (failures, record.checks.read_again())
    boxes[world].put((rank, out))


@pytest.mark.parametrize("case", ["intact", "corrupt", "a rank failed"])
def test_ranks_check_the_records_they_read_in_parts_together(tmp_path: Path, case: str) -> None:
    """Three processes each read a third of one record (the last bytes read by none), as the
    ranks of a load on another number of ranks do: the record is checked from their parts,
    the bytes no rank read are read by one rank only, and a corrupt byte, or one rank's
    failure, fails every rank."""
    import multiprocessing

    payload = os.urandom(3 << 20)
    path = tmp_path / "shard.distcp"
    record = _record(path, payload)
    if case == "corrupt":  # in the second rank's third
        raw = bytearray(path.read_bytes())
        raw[record.offset + len(payload) // 2] ^= 0x20
        path.write_bytes(bytes(raw))
    third = len(payload) // 3
    parts = [(0, third, None), (third, 2 * third, None), (2 * third, len(payload) - 10, None)]
    if case == "a rank failed":
        parts[2] = (2 * third, len(payload) - 10, "rank 2's own failure")
    context = multiprocessing.get_context("fork")
    boxes = [context.Queue() for _ in range(4)]
    ranks = [context.Process(target=_rank, args=(r, 3, record, parts, boxes)) for r in range(3)]
    for process in ranks:
        process.start()
    results = dict(boxes[3].get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    assert all(process.exitcode == 0 for process in ranks)
    failures = [results[r][0] for r in range(3)]
    assert failures[0] == failures[1] == failures[2]  # every rank knows every failure
    if case == "intact":
        assert failures[0] == [None, None, None]
        # the 10 bytes no rank read were read once, by one rank; no rank read another's part
        assert sorted(results[r][1] for r in range(3)) == [(0, 0), (0, 0), (1, 10)]
    elif case == "corrupt":
        assert sum(text is not None for text in failures[0]) == 1
        assert "shard.distcp: r fails its CRC-32 check" in next(t for t in failures[0] if t)
    else:
        assert failures[0] == [None, None, "rank 2's own failure"]
        assert all(results[r][1] == (0, 0) for r in range(3))  # nothing checked: it failed


def test_the_checks_of_two_jobs_are_their_own_and_leave_no_thread_behind(tmp_path: Path) -> None:
    """Each storage (each job) owns its checks: a record that failed in one job's checks is no
    failure of another's, which checks it afresh; once idle, no checking thread is left (a
    training process loading checkpoint after checkpoint keeps neither records nor threads)."""
    import threading

    payload = os.urandom(1 << 20)
    path = tmp_path / "bad.pt"
    first = _record(path, payload)
    raw = bytearray(path.read_bytes())
    raw[first.offset + 10] ^= 0x01
    path.write_bytes(bytes(raw))
    record_checks.ask(first)
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        CHECKS.settle([str(path)])
    other = record_checks.RecordChecks()
    other.settle([str(path)])  # nothing asked of these checks: nothing to fail
    again = other.record(first.path, first.offset, first.nbytes, first.crc, first.name)
    record_checks.ask(again)
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        other.settle([str(path)])  # checked afresh, and failed on its own
    for thread in threading.enumerate():  # (one may be between its last check and its end)
        if thread.name == "ckptctl-crc":
            thread.join(timeout=10)
    assert not any(t.name == "ckptctl-crc" and t.is_alive() for t in threading.enumerate())
