"""DiskAhead: a writer's source bytes are read into the page cache ahead of it, in its order,
never further ahead than asked. The page cache itself is the judge (``mincore``): a file's
pages are evicted with ``posix_fadvise(DONTNEED)``, then counted resident."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from ckptctl.io import disk_ahead
from ckptctl.io.disk_ahead import DiskAhead, Extent, merged
from tests.page_cache import cold_file as _cold_file
from tests.page_cache import resident as _resident

PAGE = mmap.PAGESIZE
MiB = 1 << 20


def _wait(ahead: DiskAhead) -> None:
    ahead._thread.join(timeout=30)
    assert not ahead._thread.is_alive()


def test_extents_of_one_file_that_touch_are_read_as_one() -> None:
    extents = [
        Extent("a", 0, 10, 10),
        Extent("a", 10, 5, 1),  # touches: merged, weights add up
        Extent("a", 15 + disk_ahead.GAP, 5, 5),  # within the gap: merged
        Extent("b", 0, 5, 5),  # another file
        Extent("a", 0, 5, 5),  # back to the first file: kept in order, not merged
    ]
    assert merged(extents) == [
        Extent("a", 0, 20 + disk_ahead.GAP, 16),
        Extent("b", 0, 5, 5),
        Extent("a", 0, 5, 5),
    ]
    assert merged([Extent("a", 0, 10, 10), Extent("a", 11 + disk_ahead.GAP, 1, 1)]) == [
        Extent("a", 0, 10, 10),
        Extent("a", 11 + disk_ahead.GAP, 1, 1),
    ]


def test_the_extents_are_in_the_page_cache_and_nothing_else(tmp_path: Path) -> None:
    path = _cold_file(tmp_path, 24 * MiB)
    wanted = [(2 * MiB, 3 * MiB), (12 * MiB, 5 * MiB)]  # two ranges, far apart
    ahead = DiskAhead([Extent(str(path), o, n, n) for o, n in wanted], lambda: 0, ahead=64 * MiB)
    _wait(ahead)
    resident = _resident(path)
    for offset, nbytes in wanted:
        assert all(resident[offset // PAGE : (offset + nbytes) // PAGE]), (offset, nbytes)
    # The kernel may read a little around what was asked, never the whole file.
    assert sum(resident) * PAGE < 24 * MiB


def test_it_stays_ahead_of_the_writer_by_at_most_what_it_was_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[tuple[int, int]] = []
    monkeypatch.setattr(disk_ahead, "read_into_cache", lambda fd, o, n, sink: read.append((o, n)))
    consumed = [0]
    extents = [Extent(str(tmp_path / "f"), 0, 64 * MiB, 32 * MiB)]  # every byte weighs half
    (tmp_path / "f").write_bytes(b"")
    ahead = DiskAhead(extents, lambda: consumed[0], ahead=8 * MiB)
    time.sleep(0.2)
    # 8 MiB of weight ahead is 16 MiB of the file, plus the piece that crossed the line.
    assert sum(n for _, n in read) <= 16 * MiB + disk_ahead.PIECE
    assert [o for o, _ in read] == sorted(o for o, _ in read)  # in order
    consumed[0] = 32 * MiB  # the writer is done: the rest follows
    _wait(ahead)
    assert sum(n for _, n in read) == 64 * MiB
    ahead.close()


def test_close_stops_it_while_it_waits_for_the_writer(tmp_path: Path) -> None:
    path = _cold_file(tmp_path, 48 * MiB)
    ahead = DiskAhead([Extent(str(path), 0, 48 * MiB, 48 * MiB)], lambda: 0, ahead=0)
    ahead.close()  # returns although the writer never consumes a byte
    time.sleep(0.2)
    # The first piece and whatever the kernel read ahead of it; not the file.
    assert sum(_resident(path)) * PAGE <= 24 * MiB


def test_a_missing_file_is_only_a_lost_hint(tmp_path: Path) -> None:
    ahead = DiskAhead([Extent(str(tmp_path / "gone"), 0, MiB, MiB)], lambda: 0)
    _wait(ahead)  # the thread ends quietly; the writer's own read reports the file
    ahead.close()


def test_ranges_already_cached_are_neither_read_again_nor_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "warm.bin"
    path.write_bytes(os.urandom(16 * MiB))  # just written: in the page cache
    if not all(_resident(path)):
        pytest.skip("the file's pages are not cached after writing it")
    read: list[int] = []
    monkeypatch.setattr(disk_ahead, "read_into_cache", lambda fd, o, n, sink: read.append(o))
    # Nothing consumed and nothing allowed ahead: only skipping cached ranges lets it finish.
    ahead = DiskAhead([Extent(str(path), 0, 16 * MiB, 16 * MiB)], lambda: 0, ahead=0)
    _wait(ahead)
    assert read == []


def test_asking_whether_a_range_is_cached_reads_none_of_it(tmp_path: Path) -> None:
    """The check before each piece must not bring pages in itself: a read that starts the
    kernel's read-ahead at the end of a piece breaks the sequential stream the thread's
    reads make (and fills the cache on its own)."""
    path = _cold_file(tmp_path, 16 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        if disk_ahead.cached_pages(fd, 0, PAGE) is None:
            pytest.skip("no cachestat(2) here (Linux 6.5+): the fallback check reads a byte")
        for offset in range(0, 16 * MiB, 4 * MiB):
            assert not disk_ahead.cached(fd, offset, 4 * MiB)
    finally:
        os.close(fd)
    assert not any(_resident(path))


def test_a_range_cached_at_both_ends_but_not_between_is_not_cached(tmp_path: Path) -> None:
    path = _cold_file(tmp_path, 8 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        if disk_ahead.cached_pages(fd, 0, PAGE) is None:
            pytest.skip("no cachestat(2) here (Linux 6.5+): the fallback checks the ends")
        sink = os.open(os.devnull, os.O_WRONLY)
        for offset in (0, 8 * MiB - PAGE):  # one page at each end, with no read-ahead
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            disk_ahead.read_into_cache(fd, offset, PAGE, sink)
        os.close(sink)
        resident = _resident(path)
        assert resident[0] and resident[-1] and not all(resident)
        assert not disk_ahead.cached(fd, 0, 8 * MiB)
        assert disk_ahead.cached(fd, 0, PAGE) and disk_ahead.cached(fd, 8 * MiB - PAGE, PAGE)
        assert disk_ahead.cached_pages(fd, 0, 8 * MiB) == sum(resident)
    finally:
        os.close(fd)


def test_a_writer_that_has_read_other_files_before_is_still_kept_pace_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An assembler's count of consumed bytes runs on over the files it writes: a file's
    thread measures from where the count stood when it started."""
    read: list[int] = []
    monkeypatch.setattr(disk_ahead, "read_into_cache", lambda fd, o, n, sink: read.append(n))
    (tmp_path / "f").write_bytes(b"")
    consumed = [512 * MiB]  # earlier files of the same writer
    extents = [Extent(str(tmp_path / "f"), 0, 64 * MiB, 64 * MiB)]
    ahead = DiskAhead(extents, lambda: consumed[0], ahead=8 * MiB)
    time.sleep(0.2)
    assert sum(read) <= 8 * MiB + disk_ahead.PIECE
    ahead.close()


def test_in_file_order_reads_each_file_once_in_the_order_first_needed() -> None:
    """A merge needs its two shards' ranges alternately; read as ``cp`` reads, each file is
    one span from its first needed byte to its last, the file needed first read first, and
    ranges far apart in a file stay apart (the bytes between are not needed). A span starts
    on a piece's boundary, up to a piece before its first needed byte."""
    gap = 64 * MiB
    extents = [
        Extent("b", 5 * MiB, MiB, MiB),
        Extent("a", 0, MiB, MiB),
        Extent("b", 0, MiB, MiB),
        Extent("a", 2 * MiB, MiB, 2 * MiB),
        Extent("a", 3 * MiB + gap + 1, MiB, MiB),
    ]
    spans = disk_ahead.in_file_order(extents, gap)
    assert [(e.path, e.offset, e.nbytes, e.weight) for e in spans] == [
        ("b", 0, 6 * MiB, 2 * MiB),
        ("a", 0, 3 * MiB, 3 * MiB),
        ("a", 64 * MiB, 4 * MiB + 1, MiB),
    ]
    assert gap % disk_ahead.PIECE == 0 and 4 * MiB == disk_ahead.PIECE


def test_the_source_reader_reads_the_needed_spans_unpaced(tmp_path: Path) -> None:
    """Nobody consumes anything, yet every needed span comes into the page cache, and the
    bytes far from any needed range do not."""
    path = _cold_file(tmp_path, 96 * MiB)
    extents = [Extent(str(path), 8 * MiB, 4 * MiB, 4 * MiB), Extent(str(path), 0, MiB, MiB)]
    extents.append(Extent(str(path), 88 * MiB, 8 * MiB, 8 * MiB))
    reader = disk_ahead.SourceReader(extents)
    assert reader.active
    assert reader._reading is not None
    _wait(reader._reading)
    reader.close()
    resident = _resident(path)
    pages = [
        (0, 12 * MiB),  # the first span: from its first needed byte to its last
        (88 * MiB, 96 * MiB),
    ]
    for lo, hi in pages:
        assert all(resident[lo // PAGE : hi // PAGE])
    assert not any(resident[40 * MiB // PAGE : 72 * MiB // PAGE])


def test_the_source_reader_reads_in_few_large_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every call's return waits for the GIL (5 ms beside a busy thread), so the stream asks
    for ``STREAM_PIECE`` bytes at a time, not ``PIECE``: a 96 MiB span in 4 MiB calls read at
    a quarter of the disk's speed beside the job's other threads."""
    monkeypatch.setattr(disk_ahead, "STREAM_PIECE", 40 * MiB)
    calls: list[int] = []
    real = disk_ahead.read_into_cache

    def counted(fd: int, offset: int, nbytes: int, sink: int) -> None:
        calls.append(nbytes)
        real(fd, offset, nbytes, sink)

    monkeypatch.setattr(disk_ahead, "read_into_cache", counted)
    path = _cold_file(tmp_path, 96 * MiB)
    reader = disk_ahead.SourceReader([Extent(str(path), 0, 96 * MiB, 96 * MiB)])
    assert reader._reading is not None
    _wait(reader._reading)
    reader.close()
    assert calls == [40 * MiB, 40 * MiB, 16 * MiB]
    assert all(_resident(path))


def test_a_source_larger_than_half_the_free_memory_is_left_to_the_paced_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _cold_file(tmp_path, 8 * MiB)
    monkeypatch.setattr(disk_ahead, "available_memory", lambda: 15 * MiB)
    reader = disk_ahead.SourceReader([Extent(str(path), 0, 8 * MiB, 8 * MiB)])
    assert not reader.active
    reader.close()
    assert not any(_resident(path))
    assert disk_ahead.available_memory() > 0 or not Path("/proc/meminfo").exists()


def test_the_source_reader_holds_the_writeback_until_it_has_read_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the reader runs, writeback requests wait (the device reads first); once it has
    read its spans they go out, and a reader closed early releases its hold too."""
    path = _cold_file(tmp_path, 16 * MiB)
    asked: list[int] = []
    monkeypatch.setattr(disk_ahead.writeback, "start_writeback", lambda fd, o, n: asked.append(n))
    release = threading.Event()
    real_read = disk_ahead.read_into_cache

    def slow_read(fd: int, offset: int, nbytes: int, sink: int) -> None:
        release.wait(10)
        real_read(fd, offset, nbytes, sink)

    monkeypatch.setattr(disk_ahead, "read_into_cache", slow_read)
    reader = disk_ahead.SourceReader([Extent(str(path), 0, 16 * MiB, 16 * MiB)])
    out = tmp_path / "out.bin"
    with out.open("wb") as f:
        assert reader.holding
        assert disk_ahead.writeback.request_writeback(f.fileno(), 0, 4096) is True
        disk_ahead.writeback.wait_for_requests()
        assert asked == []
        release.set()
        assert reader._reading is not None
        _wait(reader._reading)
        assert not reader.holding
        disk_ahead.writeback.wait_for_requests()
        assert asked == [4096]
    reader.close()
    assert all(_resident(path))

    release.clear()
    stopped = disk_ahead.SourceReader([Extent(str(_cold_file(tmp_path, MiB, "b")), 0, MiB, MiB)])
    assert stopped.holding and disk_ahead.writeback._holds == 1
    release.set()
    stopped.close()  # stopped while it reads: the hold ends with it
    assert not stopped.holding and disk_ahead.writeback._holds == 0
