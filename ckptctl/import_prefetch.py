"""Bring the CLI's own module files into the page cache at once, before they are imported.

When the whole page cache is cold (a node's first job, or after the cache was dropped), the
interpreter imports ~480 modules (52 MB) for a conversion, one small read after another: the
disk idles between them, and a conversion's early source reads (``read_early``) queue ahead of
each, so the imports end only after the source is read (0.3 -> 0.9 s before converting).
Asked all at once, on a few threads, the disk reads them together first, and the imports then
run from memory beside the stream. Measured with the whole cache emptied, a TP2 PP2 -> TP4 PP1
reshard of 2.28 GB, 4 interleaved rounds, medians: 2.14 -> 1.96 s (``cp -r`` 1.87 s).

Which files: those the last successful conversion on this interpreter imported, recorded when
it finished (``record``) in the user's cache folder (``$XDG_CACHE_HOME/ckptctl`` or
``~/.cache/ckptctl``), one list per interpreter and ckptctl installation. Only a hint: a
missing or stale list, or a cache folder that cannot be written, changes nothing but speed,
and listed files are only opened for reading and advised (``posix_fadvise(WILLNEED)``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading

THREADS = 8
"""Threads asking for the files: each open of a cold file waits for its folder's and inode's
reads, so several at once keep the disk's queue filled."""


def list_path() -> str | None:
    """Where this interpreter's and installation's list is kept (``None``: no home folder). A
    relative ``XDG_CACHE_HOME`` is ignored, as the XDG base directory specification says."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    tag = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{here}".encode()).hexdigest()[:16]
    return os.path.join(base, "ckptctl", f"imports-{tag}.txt")


def module_files() -> list[str]:
    """The files of every module imported so far: its compiled bytecode and its own file (the
    interpreter reads one or the other; an extension has only its shared library)."""
    found = set()
    for module in list(sys.modules.values()):
        for path in (getattr(module, "__cached__", None), getattr(module, "__file__", None)):
            if isinstance(path, str) and os.path.isabs(path):
                found.add(path)
    return sorted(found)


def record() -> None:
    """Keep this process's module files as the list for the next cold start (written only
    when it differs from the one kept; replaced whole, so a reader never sees half of one)."""
    target = list_path()
    if target is None:
        return
    text = "\n".join(module_files()) + "\n"
    with contextlib.suppress(OSError), open(target, encoding="utf-8") as f:
        if f.read() == text:
            return
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = f"{target}.{os.getpid()}.partial"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(partial, target)


def _advise(paths: list[str]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone since the list was made
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # (a platform without the call)
            pass
        finally:
            os.close(fd)


def start() -> list[threading.Thread]:
    """Ask for every listed file on ``THREADS`` background threads, returned (a caller may
    wait for them; the CLI does not: the imports find each file as soon as it is in)."""
    source = list_path()
    if source is None:
        return []
    try:
        with open(source, encoding="utf-8") as f:
            paths = [line for line in f.read().splitlines() if os.path.isabs(line)]
    except OSError:
        return []
    threads = [
        threading.Thread(
            target=_advise, args=(paths[i::THREADS],), daemon=True, name="ckptctl-prefetch"
        )
        for i in range(min(THREADS, len(paths)))
    ]
    for thread in threads:
        thread.start()
    return threads
