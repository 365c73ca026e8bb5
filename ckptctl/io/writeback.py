"""Ask Linux to start writing a file's dirty pages to the device now, without waiting for it.

Python's ``os`` has no ``sync_file_range``, so it is called from the C library. Without it a
large output sits dirty in the page cache until the kernel's dirty threshold (a share of RAM:
gigabytes) or the flush before the manifest, so the device idles while a job computes and that
flush then waits for all of it; started early, the writeback overlaps the work. The requests
are made on a background thread: the call blocks while the device's queue is full, and the
writing thread should go on producing bytes meanwhile.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
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


_requests: ThreadPoolExecutor | None = None
_requests_lock = threading.Lock()


MAX_PENDING = 16
"""Requests queued at most (each holds a duplicate descriptor): a writer far ahead of a slow
device has later requests declined, and asks again for the larger range later."""
_pending = 0


def _submit(fd: int, offset: int, nbytes: int) -> Future[bool]:
    """Queue ``start_writeback`` of ``fd`` (a duplicate, closed once done); with
    ``_requests_lock`` held."""
    global _requests, _pending
    if _requests is None:
        _requests = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-writeback")
    _pending += 1
    return _requests.submit(_start_and_close, fd, offset, nbytes)


def request_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> Future[bool] | bool | None:
    """``start_writeback`` on a background thread, on a duplicate of ``fd`` (the caller may
    close its own at once); ``None`` where the system cannot, ``False`` when ``MAX_PENDING``
    requests wait already (nothing is queued: ask again for the range later)."""
    if not available():
        return None
    with _requests_lock:
        if _pending >= MAX_PENDING:
            return False
        return _submit(os.dup(fd), offset, nbytes)


def _start_and_close(fd: int, offset: int, nbytes: int) -> bool:
    global _pending
    try:
        return start_writeback(fd, offset, nbytes)
    finally:
        os.close(fd)
        with _requests_lock:
            _pending -= 1


def _forget_in_child() -> None:
    """A forked child has no request thread (and may have copied the lock held): it starts
    afresh, or its first ``wait_for_requests`` would wait for a thread that is not there."""
    global _requests, _requests_lock, _pending
    _requests, _requests_lock, _pending = None, threading.Lock(), 0


os.register_at_fork(after_in_child=_forget_in_child)


def wait_for_requests() -> None:
    """Return once every request made so far has been handed to the kernel (they run in
    order on one thread)."""
    with _requests_lock:
        requests = _requests
    if requests is not None:
        requests.submit(lambda: None).result()
