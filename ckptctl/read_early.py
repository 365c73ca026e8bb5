"""Read a local source into the page cache while the interpreter is still importing.

A conversion knows which bytes it reads only once its plan is made, about 0.2 s after the
process starts (most of it imports); until then the disk idles. The ``ckptctl`` program's
entry (``ckptctl.cli.launch``) starts this reader first, on the files of the source the
command names, and the job stops it when its own reader (``disk_ahead.SourceReader``), which
reads exactly the planned bytes, takes over. Measured, a cold 2.28 GB merge's disk started
reading 0.25 s after the process did; with this, at once (cold source, 4 interleaved rounds,
medians: the merge 1.68 -> 1.52 s, HF 0.73 -> 0.69 s). When the CLI's own modules must come
from the disk too, only for a job that reads its whole source (``launch.reads_whole_source``):
the imports then wait behind the early reads (0.3 -> 0.9 s before the job starts converting),
and only the source's bytes read meanwhile make up for it.

Only a hint, and bounded: the files are read in path order, each by ``sendfile`` to
``/dev/null`` (no copy to user space), only when all of them fit in half of the memory
available; symbolic links are not followed (nothing outside the source is touched); and the
bytes read before the handover are at most what the disk reads in those 0.2 s, some of them
perhaps not needed (a source holding several checkpoints, or a job reading only weights).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading

PIECE = 4 << 20
"""Bytes read per call (between two looks at whether to stop; ``DiskAhead``: at how far the
writer has come)."""


def available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def read_into_cache(fd: int, offset: int, nbytes: int, sink: int) -> None:
    """Bring ``nbytes`` of ``fd`` from ``offset`` into the page cache: ``sendfile`` to
    ``sink`` (``/dev/null``) reads them through the cache and copies nothing."""
    while nbytes > 0:
        n = os.sendfile(sink, fd, offset, nbytes)
        if n <= 0:  # the end of the file
            return
        offset, nbytes = offset + n, nbytes - n


def byte_cached(fd: int, offset: int) -> bool:
    """Whether byte ``offset`` of ``fd`` is in the page cache: a one-byte ``RWF_NOWAIT`` read,
    which returns at once instead of waiting for the disk (``False`` where the flag is
    missing)."""
    try:
        return os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT) == 1
    except (OSError, AttributeError):  # not cached (EAGAIN), or no such flag here
        return False


EARLY_PIECE = 64 << 20
"""Bytes read per call before the job's reader takes over. The imports hold the GIL most of
that time, and every call's return waits for it (``disk_ahead.STREAM_PIECE``): in 4 MiB calls
the early reads lost 0.13 s of a cold-source reshard against 64 MiB ones (2.03 -> 1.88 s,
medians of 4 interleaved rounds). The handover (``stop``) waits for the current call: 25 ms
at most at this disk's speed."""

_stop = threading.Event()
_thread: threading.Thread | None = None


def files_under(root: str) -> list[tuple[str, int]]:
    """The regular files of ``root`` (a file or a folder; links not followed), in path order,
    with their sizes."""
    if os.path.isfile(root) and not os.path.islink(root):
        return [(root, os.path.getsize(root))]
    found = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode):
                    found.append((path, info.st_size))
    return found


def start(root: str) -> None:
    """Start reading the files of local source ``root`` into the page cache on a background
    thread, which first lists them (a folder of thousands of files takes a while; the
    imports go on meanwhile) and reads only if they fit in half of the memory available."""
    global _thread
    if _thread is not None:
        return
    _stop.clear()
    _thread = threading.Thread(target=_read, args=(root,), daemon=True, name="ckptctl-read-early")
    _thread.start()


def _read(root: str) -> None:
    files = files_under(root)
    if sum(size for _, size in files) > available_memory() // 2:
        return
    with contextlib.suppress(OSError), open(os.devnull, "wb") as sink:
        for path, size in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                for offset in range(0, size, EARLY_PIECE):
                    if _stop.is_set():
                        return
                    read_into_cache(fd, offset, min(EARLY_PIECE, size - offset), sink.fileno())
            finally:
                os.close(fd)


def stop() -> None:
    """Stop the early reader (the job's own reader takes over); waits for its last piece."""
    global _thread
    thread, _thread = _thread, None
    if thread is not None:
        _stop.set()
        thread.join()
