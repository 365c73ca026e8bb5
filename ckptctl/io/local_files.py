"""Local paths through the OS, with the few file-system calls ``Storage`` makes.

fsspec is imported only for remote URLs: importing it (with asyncio, which it pulls in) costs
~30 ms of every command's start-up, 3% of a one-second local conversion, for calls that are
each one system call here. Paths are spelled as fsspec spells local ones (absolute, ``~``
expanded, ``file://`` dropped, not otherwise normalised), so roots, messages and the checks
that keep outputs out of sources see the same strings whichever way a URL came in.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from typing import Any, BinaryIO, cast

from ckptctl.errors import CheckpointError

LOCAL_PROTOCOLS = ("file", "local")


def protocol_of(url: str) -> str:
    """The URL's scheme as fsspec reads it (``file`` when there is none; the first of a chain
    such as ``simplecache::s3://``)."""
    parts = re.split(r"(::|://)", url, maxsplit=1)
    return parts[0] if len(parts) > 1 else "file"


def local_root(url: str) -> str | None:
    """The absolute path a local URL names, or None for any other URL (chained ones included)."""
    if "::" in url or protocol_of(url) not in LOCAL_PROTOCOLS:
        return None
    for prefix in ("file://", "local://", "file:", "local:"):
        if url.startswith(prefix):
            url = url.removeprefix(prefix)
            break
    if url.startswith("/"):
        path = url
    elif url.startswith("~"):
        path = os.path.expanduser(url)
    else:
        path = f"{os.getcwd()}/{'' if url == '.' else url.removeprefix('./')}"
    return path.rstrip("/") or "/"


def refuse_irregular(path: str) -> None:
    """Checkpoints are read from regular files only: a FIFO would block the read forever, a
    device (a link to ``/dev/zero``) never end it, a directory is no file; a missing file is
    left to ``open`` to report."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise CheckpointError(
            f"{path} is {kind}, not a regular file; refusing to read it",
            hint="a checkpoint's files must be regular files (or links to them)",
        )


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class LocalFiles:
    """The calls ``Storage`` makes of a file system for local paths (it writes local files
    through the OS itself): each one system call."""

    protocol = LOCAL_PROTOCOLS

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def ls(self, path: str, detail: bool = False) -> list[str]:
        """Full paths of a directory's entries (a file lists itself, as fsspec's does)."""
        if not os.path.isdir(path):
            if os.path.exists(path):
                return [path]
            raise FileNotFoundError(path)
        with os.scandir(path) as entries:
            return [f"{path.rstrip('/')}/{entry.name}" for entry in entries]

    def find(self, path: str) -> list[str]:
        """Every file below ``path``. Links are leaves, as in fsspec: a link to a directory is
        listed, never walked into (a link loop in an untrusted checkpoint would never end)."""
        if not os.path.isdir(path):
            if os.path.exists(path):
                return [path]
            raise FileNotFoundError(path)
        found = []
        for folder, folders, names in os.walk(path.rstrip("/") or "/"):
            found += [os.path.join(folder, name) for name in names]
            links = (os.path.join(folder, name) for name in folders)
            found += [link for link in links if os.path.islink(link)]
        return sorted(found)

    def open(self, path: str, mode: str = "rb", **_: Any) -> BinaryIO:
        if "r" in mode:
            refuse_irregular(path)
        return cast(BinaryIO, open(path, mode))  # the caller closes it (a binary mode)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        refuse_irregular(path)
        with open(path, "rb") as f:
            f.seek(start or 0)
            return f.read() if end is None else f.read(max(0, end - (start or 0)))

    def rm(self, path: str, recursive: bool = False) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            if not recursive:
                raise IsADirectoryError(path)
            shutil.rmtree(path)
        else:
            os.remove(path)
