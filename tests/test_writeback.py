"""Early writeback requests (``sync_file_range`` on a background thread) in a forked child."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from ckptctl.io import writeback

pytestmark = pytest.mark.skipif(not writeback.available(), reason="no sync_file_range here")


def _request_and_wait(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"y" * 4096)
        f.flush()
        writeback.request_writeback(f.fileno())
    writeback.wait_for_requests()


def test_a_forked_child_makes_and_waits_for_its_own_requests(tmp_path: Path) -> None:
    """The parent's request thread is not copied by a fork: a child that waited for it
    would hang (as it did before the state was reset in the child)."""
    path = tmp_path / "out.bin"
    with path.open("wb") as f:
        f.write(b"x" * 4096)
        f.flush()
        assert writeback.request_writeback(f.fileno()) is not None
    writeback.wait_for_requests()  # the parent's thread now exists

    child = multiprocessing.get_context("fork").Process(target=_request_and_wait, args=(path,))
    child.start()
    child.join(timeout=15)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung and child.exitcode == 0
    assert path.stat().st_size == 8192


def _dirty_pages(fd: int) -> int | None:
    """Dirty pages of the whole file (``cachestat(2)``, Linux 6.5), ``None`` where unknown."""
    from ckptctl.io.disk_ahead import CACHESTAT, _Cachestat, _CachestatRange, _syscall

    syscall = _syscall()
    if syscall is None:
        return None
    span, stat = _CachestatRange(0, 0), _Cachestat()
    if syscall(CACHESTAT, ctypes.c_int(fd), ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        return None
    return int(stat.nr_dirty)


def test_requests_made_while_held_reach_the_device_once_released(tmp_path: Path) -> None:
    """The kernel is the judge: the written pages stay dirty while the writeback is held
    (the kernel's own flusher waits 30 s and gigabytes), and are handed to the device (no
    longer dirty) once the hold ends."""
    path = tmp_path / "out.bin"
    with path.open("wb") as f:
        f.write(os.urandom(8 << 20))
        f.flush()
        if not _dirty_pages(f.fileno()):
            pytest.skip("this file system keeps no dirty pages, or cachestat is missing")
        writeback.hold()
        try:
            assert writeback.request_writeback(f.fileno(), 0, 4 << 20) is True
            assert writeback.request_writeback(f.fileno(), 4 << 20, 4 << 20) is True
            time.sleep(0.2)
            writeback.wait_for_requests()
            assert _dirty_pages(f.fileno()) == (8 << 20) // mmap.PAGESIZE
        finally:
            writeback.release()
        writeback.wait_for_requests()
        assert _dirty_pages(f.fileno()) == 0


def test_held_requests_of_one_file_are_joined_and_the_last_hold_releases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(writeback, "start_writeback", lambda fd, o, n: asked.append((o, n)))
    one, two = tmp_path / "one.bin", tmp_path / "two.bin"
    with one.open("wb") as a, two.open("wb") as b:
        writeback.hold()
        writeback.hold()  # two readers at once
        writeback.request_writeback(a.fileno(), 32, 32)
        writeback.request_writeback(a.fileno(), 0, 32)
        writeback.request_writeback(b.fileno(), 64, 16)
        writeback.request_writeback(b.fileno())  # to the end of the file
        writeback.release()
        writeback.wait_for_requests()
        assert asked == []  # one hold is left
        writeback.release()
        writeback.wait_for_requests()
    assert sorted(asked) == [(0, 0), (0, 64)]  # b from 0: the end-of-file request asks all
    writeback.release()  # an extra release is harmless: requests go straight through again
    with one.open("ab") as a:
        assert writeback.request_writeback(a.fileno(), 0, 1) is not True
    writeback.wait_for_requests()
    assert (0, 1) in asked
