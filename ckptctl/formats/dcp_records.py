"""Reading DCP records: one ``torch.save`` archive at ``(offset, length)`` of a ``.distcp`` file.

A zip is found from its end, so ``TorchZipReader`` on the whole file would silently open the
*last* record; ``RecordWindow`` shows it exactly one record instead. On a local disk the tensor
bytes are then read with ``pread`` (no shared file position, so parallel reads of one file
cannot interleave); on an object store ``RemoteRecord`` fetches the record's two ends once (its
pickle and zip directory live there) and everything else by exact range.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any, BinaryIO

from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_metadata import StorageInfo
from ckptctl.formats.torchzip import TensorRef, TorchZipReader
from ckptctl.geometry import Shape
from ckptctl.storage import Storage

Fetch = Callable[[int, int], bytes]
"""``fetch(start, nbytes)``: bytes of a record, by position within it."""


class RecordWindow(io.RawIOBase):
    """Read-only, seekable view of bytes ``[offset, offset + length)`` of a binary file.

    Keeps its own position and seeks the underlying file on every read, so several windows may
    share one file object (not from several threads at once).
    """

    def __init__(self, fileobj: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        if offset < 0 or length < 0:
            raise ValueError(f"negative byte range ({offset}, {length})")
        self._f = fileobj
        self._start = offset
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

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = _read_into(self._f, view[:n])
        self._pos += got
        return got


def _read_into(f: BinaryIO, view: memoryview) -> int:
    if hasattr(f, "readinto"):
        return f.readinto(view) or 0
    data = f.read(len(view))  # file objects without readinto (some remote readers)
    view[: len(data)] = data
    return len(data)


def _read_into(f: BinaryIO, view: memoryview) -> int:
    if hasattr(f, "readinto"):
        return f.readinto(view) or 0
    data = f.read(len(view))  # file objects without readinto (some remote readers)
    view[: len(data)] = data
    return len(data)


def pread(fd: int, base: int, start: int, nbytes: int) -> bytes:
    """A :data:`Fetch` over a local file descriptor, for the record at ``base``."""
    return os.pread(fd, nbytes, base + start)


class RemoteRecord(io.RawIOBase):
    """One record on an object store, read with as few requests as its layout allows.

    A ``torch.save`` archive keeps its pickle at the start and its zip directory at the end,
    with the tensor bytes between: the first and last ``EDGE`` bytes are fetched once each (the
    whole record, if it is small), and everything else by exact range."""

    EDGE = 16 << 10

    def __init__(self, storage: Storage, rel: str, offset: int, length: int) -> None:
        super().__init__()
        self.storage, self.rel, self.offset, self.length = storage, rel, offset, length
        self._pos = 0
        self._edges: list[tuple[int, bytes]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.length}[whence]
        self._pos = max(base + pos, 0)
        return self._pos

    def _edge(self, start: int) -> tuple[int, bytes]:
        for edge in self._edges:
            if edge[0] == start:
                return edge
        if self.length <= 2 * self.EDGE:
            start = 0
            data = self.storage.read_range(self.rel, self.offset, self.length)
        else:
            data = self.storage.read_range(self.rel, self.offset + start, self.EDGE)
        self._edges.append((start, data))
        return start, data

    def fetch(self, start: int, nbytes: int) -> bytes:
        """Bytes ``[start, start + nbytes)`` of the record, from an edge if they lie there."""
        nbytes = max(0, min(nbytes, self.length - start))
        small = self.length <= 2 * self.EDGE
        for edge_start in (0,) if small else (0, self.length - self.EDGE):
            if edge_start <= start and start + nbytes <= edge_start + (
                self.length if small else self.EDGE
            ):
                base, data = self._edge(edge_start)
                return data[start - base : start - base + nbytes]
        return self.storage.read_range(self.rel, self.offset + start, nbytes)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.fetch(self._pos, len(view))
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


def open_record(
    window: Any, info: StorageInfo, where: str, fetch: Fetch | None = None
) -> TorchZipReader:
    """A lazy reader of one record; ``window`` shows exactly its bytes (a ``RecordWindow`` or a
    ``RemoteRecord``), ``fetch`` reads them by range."""
    if info.transform_descriptors:
        raise CheckpointError(
            f"{where}: record uses stream transform(s) {list(info.transform_descriptors)} "
            "that ckptctl cannot undo"
        )
    return TorchZipReader(window, where, fetch)


def tensor_of(reader: TorchZipReader, dtype: str, sizes: Shape, where: str) -> TensorRef:
    """The record's one tensor, checked against the dtype and chunk shape ``.metadata``
    promises."""
    ref = reader.tree
    if not isinstance(ref, TensorRef):
        raise CheckpointError(f"{where}: record holds {type(ref).__name__}, not a tensor")
    if str(ref.dtype).removeprefix("torch.") != dtype or ref.shape != tuple(sizes):
        raise CheckpointError(
            f"{where}: record holds a {ref.dtype} tensor of shape {ref.shape}; "
            f".metadata promises {dtype} {tuple(sizes)}"
        )
    return ref


def open_tensor_record(
    fileobj: BinaryIO, info: StorageInfo, dtype: str, sizes: Shape, where: str
) -> tuple[TorchZipReader, TensorRef]:
    """Open the tensor record ``info`` locates in ``fileobj`` (the file
    ``info.relative_path``)."""
    reader = open_record(RecordWindow(fileobj, info.offset, info.length), info, where)
    return reader, tensor_of(reader, dtype, sizes, where)
