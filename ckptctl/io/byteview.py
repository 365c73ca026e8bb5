"""A read-only, seekable file object over bytes that live elsewhere (a record inside a larger
file, an object store's ranges, a compressed file's decoded chunks): subclasses only say how
bytes at a position are read."""

from __future__ import annotations

import io
from typing import Any


class ByteView(io.RawIOBase):
    """A read-only, seekable file of ``length`` bytes with its own position; subclasses say
    how ``n`` bytes at a position are read (``_read_at``)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        if length < 0:
            raise ValueError(f"negative length {length}")
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}
        if whence not in bases or bases[whence] + pos < 0:
            raise ValueError(f"invalid seek ({pos}, whence={whence})")
        self._pos = bases[whence] + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        got = self._read_at(self._pos, view[:n]) if n else 0
        self._pos += got
        return got

    def _read_at(self, pos: int, view: memoryview) -> int:
        raise NotImplementedError
