"""Whether a kernel copy (``copy_file_range``) pays on the file system a file is on.

Where a file system shares blocks between files (btrfs, XFS, bcachefs, ZFS) or copies on its
server (NFS 4.2, SMB), ``copy_file_range`` moves no bytes through memory at all. ext2/3/4 can do
neither: there the kernel copies through a pipe, 64 KiB at a time, and that costs more than
writing the same bytes from the source's mapped pages (measured on this project's 2-core VM,
2.28 GB between cached files on ext4: 0.89-1.23 s against 0.61-0.85 s, all of it CPU time; in
whole jobs, DCP -> torch 1.47 -> 1.24 s and a TP2 PP2 -> TP4 PP1 reshard 2.18 -> 1.79 s). So
runs go by kernel copy unless their target is on such a file system; file systems not known
either way keep the kernel copy, which is never wrong and is the fast path wherever blocks can
be shared.
"""

from __future__ import annotations

import ctypes
import functools
import os

COPIES_THROUGH_A_PIPE = {0xEF53: "ext2/ext3/ext4"}
"""``statfs`` magic numbers of file systems whose ``copy_file_range`` is the kernel's generic
copy through a pipe (no block sharing, no server-side copy)."""

_STATFS_SIZE = 256
"""Bytes of room for ``struct statfs`` (120 on 64-bit Linux); its first field, a ``long``, is
the file system's magic number."""


@functools.cache
def _fstatfs() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        function = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):  # not Linux, or a C library without it
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


def file_system_type(fd: int) -> int | None:
    """The ``statfs`` magic number of the file system holding ``fd`` (``None`` where the
    system cannot say)."""
    function = _fstatfs()
    if function is None:
        return None
    buffer = ctypes.create_string_buffer(_STATFS_SIZE)
    if function(fd, buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


_decided: dict[int, bool] = {}
"""Device number -> ``kernel_copy_pays`` of the files on it."""


def kernel_copy_pays(fd: int) -> bool:
    """Whether runs into the file open as ``fd`` should move by ``copy_file_range`` rather
    than by writing the source's mapped pages (decided once per device)."""
    device = os.fstat(fd).st_dev
    pays = _decided.get(device)
    if pays is None:
        pays = _decided[device] = file_system_type(fd) not in COPIES_THROUGH_A_PIPE
    return pays
