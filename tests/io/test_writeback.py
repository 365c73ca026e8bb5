"""Early writeback requests (``sync_file_range`` on a background thread) in a forked child."""

from __future__ import annotations

import multiprocessing
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
