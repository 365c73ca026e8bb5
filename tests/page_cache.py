"""The page cache as a test's judge: which pages of a file are resident (``mincore``), and a
file written, synced and evicted so that none are."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

PAGE = mmap.PAGESIZE


def resident(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache (``mincore`` of a read-only map)."""
    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as pages:
        view = np.frombuffer(pages, np.uint8)
        failed = libc.mincore(ctypes.c_void_p(view.ctypes.data), size, vec) != 0
        del view
    if failed:
        pytest.skip("mincore is not available")
    return [bool(v & 1) for v in vec]


def evict(path: Path) -> None:
    """Write ``path``'s dirty pages, then drop all of its pages from the page cache; skips the
    test where the file system keeps them (tmpfs), since nothing can then be measured."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if any(resident(path)):
        pytest.skip("this file system keeps the file's pages (tmpfs?): nothing to measure")


def cold_file(tmp_path: Path, nbytes: int, name: str = "source.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(os.urandom(nbytes))
    evict(path)
    return path
