"""Writing DCP checkpoints: tensor and byte records, and ``.metadata`` bytes that torch's own
``dcp.load`` reads.

A tensor record is a complete ``torch.save`` zip archive of one chunk, stored at
``(offset, length)`` of a ``.distcp`` file among other records. A zip records absolute
positions, so ``OffsetWriter`` makes the record's first byte position 0, as torch's own
``torch.save`` into the middle of a stream does (``records`` has the reading side).
``.metadata`` is built from torch's real DCP classes and pickled, because torch unpickles exactly
those (``parse`` reads it back without them).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import Any

from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_container.checks import metadata_problems
from ckptctl.formats.dcp_container.metadata import (
    DcpMetadata,
    StorageInfo,
)
from ckptctl.formats.dcp_container.metadata_pickle import metadata_pickle
from ckptctl.formats.torchsave.zip_writer import TensorSlot, write_torch_zip
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.runs import Run

_PICKLE_PROTOCOL = 4  # what torch's pickle.dump writes on Python 3.11-3.13; fixed for stable bytes


class OffsetWriter(io.RawIOBase):
    """Write view of a seekable binary file whose position 0 is where the file stood when the
    view was made, so archives written through it carry record-relative offsets."""

    def __init__(self, fileobj: ByteStream) -> None:
        super().__init__()
        self._f = fileobj
        self._start = fileobj.tell()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        # A forward-only stream (ckptctl's hashing writer) makes zipfile write data
        # descriptors instead of seeking back to patch headers.
        return self._f.seekable()

    def tell(self) -> int:
        return self._f.tell() - self._start

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            if pos < 0:
                raise ValueError(f"negative seek position {pos}")
            pos += self._start
        return self._f.seek(pos, whence) - self._start

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def copy_range(self, run: Run, observers: list[Any]) -> int | None:
        """A kernel copy of ``run`` when the file below takes one (``Run.write_to``)."""
        copy = getattr(self._f, "copy_range", None)
        return copy(run, observers) if copy is not None else None


def write_tensor_record(
    fileobj: ByteStream,
    relative_path: str,
    slot: TensorSlot,
    produce: Callable[[TensorSlot], Iterable[bytes | memoryview | Run]],
) -> StorageInfo:
    """Append one chunk as a ``torch.save`` archive at the current position of ``fileobj``
    (the file ``relative_path``); ``produce`` streams its bytes as for ``write_torch_zip``."""
    start = fileobj.tell()
    window = OffsetWriter(fileobj)
    write_torch_zip(window, slot, [slot], produce)
    return StorageInfo(relative_path=relative_path, offset=start, length=window.tell())


def write_bytes_record(fileobj: ByteStream, relative_path: str, payload: bytes) -> StorageInfo:
    """Append a byte item's record (e.g. one copied verbatim from a source checkpoint)."""
    start = fileobj.tell()
    fileobj.write(payload)
    return StorageInfo(relative_path=relative_path, offset=start, length=len(payload))


def metadata_bytes(md: DcpMetadata) -> bytes:
    """The ``.metadata`` file torch's ``FileSystemReader`` / ``dcp.load`` reads for ``md``.

    Refuses metadata that does not describe a readable checkpoint (``metadata_problems``): the
    file is the commit marker, so it must never promise what the records do not hold.
    """
    problems = metadata_problems(md)
    if problems:
        raise CheckpointError(f"refusing to write .metadata: {'; '.join(problems[:20])}")
    return metadata_pickle(md, _PICKLE_PROTOCOL)
