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
from typing import Any

from ckptctl.checksums.record_checks import RecordChecks
from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_container.metadata import StorageInfo
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.byteview import ByteView
from ckptctl.io.storage import Storage
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.geometry import Shape

Fetch = Callable[[int, int], bytes]
"""``fetch(start, nbytes)``: bytes of a record, by position within it."""


class RecordWindow(ByteView):
    """Bytes ``[offset, offset + length)`` of a seekable binary file.

    Seeks the underlying file on every read, so several windows may share one file object (not
    from several threads at once)."""

    def __init__(self, fileobj: ByteStream, offset: int, length: int) -> None:
        super().__init__(length)
        if offset < 0:
            raise ValueError(f"negative byte range ({offset}, {length})")
        self._f = fileobj
        self._start = offset

    @property
    def local_file(self) -> tuple[str, int] | None:
        """The local file the window shows part of, and where in it the window starts
        (``None`` for a file object that is not a plain local file)."""
        f = self._f
        if isinstance(f, io.BufferedReader) and isinstance(f.raw, io.FileIO):
            return os.path.abspath(f.name), self._start
        return None

    def _read_at(self, pos: int, view: memoryview) -> int:
        self._f.seek(self._start + pos)
        if hasattr(self._f, "readinto"):
            return self._f.readinto(view) or 0
        data = self._f.read(len(view))  # file objects without readinto (some remote readers)
        view[: len(data)] = data
        return len(data)


def pread(fd: int, base: int, start: int, nbytes: int) -> bytes:
    """A :data:`Fetch` over a local file descriptor, for the record at ``base``."""
    return os.pread(fd, nbytes, base + start)


class RemoteRecord(ByteView):
    """One record on an object store, read with as few requests as its layout allows.

    A ``torch.save`` archive keeps its pickle at the start and its zip directory at the end,
    with the tensor bytes between: the first and last ``EDGE`` bytes are fetched once each (the
    whole record, if it is small), and everything else by exact range."""

    EDGE = 16 << 10

    def __init__(self, storage: Storage, rel: str, offset: int, length: int) -> None:
        super().__init__(length)
        self.storage, self.rel, self.offset = storage, rel, offset
        self._edges: dict[int, bytes] = {}

    @property
    def _small(self) -> bool:
        return self._length <= 2 * self.EDGE

    def _edge(self, start: int) -> bytes:
        if start not in self._edges:
            size = self._length if self._small else self.EDGE
            self._edges[start] = self.storage.read_range(self.rel, self.offset + start, size)
        return self._edges[start]

    def fetch(self, start: int, nbytes: int) -> bytes:
        """Bytes ``[start, start + nbytes)`` of the record, from an edge if they lie there."""
        nbytes = max(0, min(nbytes, self._length - start))
        size = self._length if self._small else self.EDGE
        for edge in (0,) if self._small else (0, self._length - self.EDGE):
            if edge <= start and start + nbytes <= edge + size:
                return self._edge(edge)[start - edge : start - edge + nbytes]
        return self.storage.read_range(self.rel, self.offset + start, nbytes)

    def _read_at(self, pos: int, view: memoryview) -> int:
        data = self.fetch(pos, len(view))
        view[: len(data)] = data
        return len(data)


def open_record(
    window: Any,
    info: StorageInfo,
    where: str,
    fetch: Fetch | None = None,
    place: tuple[str, int] | None = None,
    stored: tuple[str, Callable[[], str]] | None = None,
    checks: RecordChecks | None = None,
) -> TorchZipReader:
    """A lazy reader of one record; ``window`` shows exactly its bytes (a ``RecordWindow`` or a
    ``RemoteRecord``), ``fetch`` reads them by range; ``place``: the file holding the record
    and the record's offset in it; ``stored``: an object's URL and version (``TorchZipReader``)."""
    if info.transform_descriptors:
        raise CheckpointError(
            f"{where}: record uses stream transform(s) {list(info.transform_descriptors)} "
            "that ckptctl cannot undo"
        )
    return TorchZipReader(window, where, fetch, place, stored, checks)


def tensor_of(reader: TorchZipReader, dtype: str, sizes: Shape, where: str) -> TensorRef:
    """The record's one tensor, checked against the dtype and chunk shape ``.metadata``
    promises."""
    ref = reader.tree
    if not isinstance(ref, TensorRef):
        raise CheckpointError(f"{where}: record holds {type(ref).__name__}, not a tensor")
    if dtype_name(ref.dtype) != dtype or ref.shape != tuple(sizes):
        raise CheckpointError(
            f"{where}: record holds a {ref.dtype} tensor of shape {ref.shape}; "
            f".metadata promises {dtype} {tuple(sizes)}"
        )
    return ref


def open_tensor_record(
    fileobj: ByteStream,
    info: StorageInfo,
    dtype: str,
    sizes: Shape,
    where: str,
    checks: RecordChecks | None = None,
) -> tuple[TorchZipReader, TensorRef]:
    """Open the tensor record ``info`` locates in ``fileobj`` (the file
    ``info.relative_path``)."""
    reader = open_record(
        RecordWindow(fileobj, info.offset, info.length), info, where, checks=checks
    )
    return reader, tensor_of(reader, dtype, sizes, where)
