"""Ask Linux to start writing a file's dirty pages to the device now, without waiting.

Python's ``os`` has no ``sync_file_range``, so it is called from the C library. Without it a
large output sits dirty in the page cache until the kernel's dirty threshold (a share of RAM:
gigabytes) or the flush before the manifest, so the device idles while a job computes and that
flush then waits for all of it; started early, the writeback overlaps the work.
"""

from __future__ import annotations

import functools
from typing import Any

SYNC_FILE_RANGE_WRITE = 2
"""From <linux/fs.h>: start writeback of dirty pages in the range, do not wait for it."""


@functools.cache
def _libc_sync_file_range() -> Any:
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux, or a C library without it
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def available() -> bool:
    return _libc_sync_file_range() is not None


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> bool:
    """Start writeback of ``nbytes`` from ``offset`` (0: to the end of the file) of ``fd``;
    ``False`` where the system cannot (then the final flush does it all)."""
    function = _libc_sync_file_range()
    if function is None:
        return False
    return function(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) == 0
