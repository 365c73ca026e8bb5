"""Reading boxes of safetensors tensors: only the rows a box spans are fetched (from a file,
or by ranged GETs of an object), straight into array memory where they can be."""

from __future__ import annotations

from math import prod
from typing import Any, Protocol

import numpy as np

from ckptctl.arrays import buffer, numpy_dtype, words
from ckptctl.errors import CheckpointError
from ckptctl.formats.safetensors_header import SafetensorsEntry
from ckptctl.io.storage import Storage


class SeekAndRead(Protocol):
    """What ``read_box`` needs of a file: a file, or ranged GETs of an object (``RangeFile``)."""

    def seek(self, pos: int, /) -> object: ...

    def read(self, size: int, /) -> bytes | None: ...


def read_box(
    f: SeekAndRead,
    entry: SafetensorsEntry,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    into: np.ndarray | None = None,
    where: str = "safetensors file",
) -> np.ndarray:
    """Read box ``[offsets, offsets + sizes)``: only the rows spanning it are fetched, straight
    into array memory (into ``into`` itself when the box is whole rows of the same dtype);
    ``where`` names the file in errors."""
    dtype = numpy_dtype(entry.dtype)
    if not entry.shape:
        rows, row_elems, lo = 1, 1, 0
    else:
        row_elems = prod(entry.shape[1:])
        lo = offsets[0]
        rows = sizes[0]
    if rows == 0 or prod(sizes) == 0:
        return np.empty(sizes, dtype)
    whole_rows = tuple(sizes[1:]) == tuple(entry.shape[1:])
    direct = (
        into is not None
        and whole_rows
        and into.dtype == dtype
        and into.flags.c_contiguous
        and tuple(into.shape) == tuple(sizes)
    )
    flat = into.reshape(-1) if into is not None and direct else np.empty(rows * row_elems, dtype)
    f.seek(entry.begin + lo * row_elems * dtype.itemsize)
    _read_exactly(f, buffer(words(flat)).cast("B"), where)
    if into is not None and direct:
        return into
    block = flat.reshape((rows, *entry.shape[1:]) if entry.shape else ())
    if entry.shape and not whole_rows:
        inner = zip(offsets[1:], sizes[1:], strict=True)
        block = np.ascontiguousarray(block[(slice(None), *(slice(o, o + s) for o, s in inner))])
    return block


def _read_exactly(f: Any, view: memoryview, where: str) -> None:
    """Fill ``view`` from ``f``: by ``readinto`` on files, else one exact read (ranged GET)."""
    truncated = CheckpointError(
        f"{where}: ends before the tensor bytes its header promises; the file is truncated"
    )
    if not hasattr(f, "readinto"):
        data = f.read(len(view))
        if len(data) != len(view):
            raise truncated
        view[:] = data
        return
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise truncated
        got += n


class RangeFile:
    """Just enough of a file for ``read_box``: a seek and one exact ranged read."""

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage, self.path, self.pos = storage, path, 0

    def seek(self, pos: int) -> None:
        self.pos = pos

    def read(self, nbytes: int) -> bytes:
        return self.storage.read_range(self.path, self.pos, nbytes)
