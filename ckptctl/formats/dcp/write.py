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
import pickle
from collections.abc import Callable, Iterable
from typing import BinaryIO

from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp.checks import metadata_problems
from ckptctl.formats.dcp.metadata import (
    BytesEntry,
    DcpMetadata,
    StorageInfo,
    TensorEntry,
)
from ckptctl.formats.torchsave.zip_writer import TensorSlot, write_torch_zip

_PICKLE_PROTOCOL = 4  # what torch's pickle.dump writes on Python 3.11-3.13; fixed for stable bytes


class OffsetWriter(io.RawIOBase):
    """Write view of a seekable binary file whose position 0 is where the file stood when the
    view was made, so archives written through it carry record-relative offsets."""

    def __init__(self, fileobj: BinaryIO) -> None:
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


def write_tensor_record(
    fileobj: BinaryIO,
    relative_path: str,
    slot: TensorSlot,
    produce: Callable[[TensorSlot], Iterable[bytes | memoryview]],
) -> StorageInfo:
    """Append one chunk as a ``torch.save`` archive at the current position of ``fileobj``
    (the file ``relative_path``); ``produce`` streams its bytes as for ``write_torch_zip``."""
    start = fileobj.tell()
    window = OffsetWriter(fileobj)
    write_torch_zip(window, slot, [slot], produce)  # type: ignore[arg-type]
    return StorageInfo(relative_path=relative_path, offset=start, length=window.tell())


def write_bytes_record(fileobj: BinaryIO, relative_path: str, payload: bytes) -> StorageInfo:
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
    # Imported here: torch.distributed.checkpoint takes ~0.7 s to import and only writing
    # needs its classes. ``_StorageInfo`` is private, but it is the class torch's reader
    # expects in ``storage_data``.
    import torch
    from torch.distributed.checkpoint import metadata as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def entry(e: TensorEntry | BytesEntry) -> dcp.TensorStorageMetadata | dcp.BytesStorageMetadata:
        if isinstance(e, BytesEntry):
            return dcp.BytesStorageMetadata()
        return dcp.TensorStorageMetadata(
            properties=dcp.TensorProperties(dtype=getattr(torch, e.dtype)),
            size=torch.Size(e.shape),
            chunks=[
                dcp.ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                for c in e.chunks
            ],
        )

    storage = {
        dcp.MetadataIndex(fqn, offsets): _StorageInfo(
            info.relative_path,
            info.offset,
            info.length,
            list(info.transform_descriptors) or None,
        )
        for (fqn, offsets), info in md.storage.items()
    }
    # torch's planners look key paths up in planner_data; a flat name is its own path.
    planner_data = md.planner_data or {fqn: (fqn,) for fqn in md.entries}
    out = dcp.Metadata(
        state_dict_metadata={fqn: entry(e) for fqn, e in md.entries.items()},
        planner_data=dict(planner_data),
        storage_data=storage,
    )
    # Set after construction: fields that older torch's Metadata lacks stay plain attributes.
    if md.save_info is not None:
        meta = md.save_info
        out.storage_meta = dcp.StorageMeta(
            checkpoint_id=meta.checkpoint_id,
            save_id=meta.save_id,
            load_id=meta.load_id,
            modules=list(meta.modules),
        )
    if md.version is not None:
        out.version = md.version
    return pickle.dumps(out, protocol=_PICKLE_PROTOCOL)
