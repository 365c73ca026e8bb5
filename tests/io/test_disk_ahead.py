"""DiskAhead: a writer's source bytes are read into the page cache ahead of it, in its order,
never further ahead than asked. The page cache itself is the judge (``mincore``): a file's
pages are evicted with ``posix_fadvise(DONTNEED)``, then counted resident."""

from __future__ import annotations

import mmap
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
