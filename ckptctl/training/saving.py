"""Saving a rank's part of a training state: staging it in host memory, streaming it to one
``.distcp`` file, and (rank 0) committing the checkpoint once every rank has finished.

The layout is torch DCP's (``__<rank>_0.distcp`` files of ``torch.save`` records, ``.metadata``
last), so torch's ``dcp.load`` and every ckptctl command read it. ckptctl adds its own markers
around it: ``ckptctl.incomplete`` before any rank writes, and ``ckptctl.manifest.json`` (every
file's size and checksum) after ``.metadata``; a directory is a complete checkpoint only when the
manifest is there and the marker is not.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import xxhash

from ckptctl import __version__
from ckptctl.arrays import from_torch, raw_bytes
from ckptctl.checksums.manifest import INCOMPLETE, MANIFEST, MANIFEST_VERSION
from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_container.metadata import (
    DCP_VERSION,
    METADATA_FILE,
    BytesEntry,
    Chunk,
    DcpMetadata,
    SaveInfo,
    StorageInfo,
    TensorEntry,
)
from ckptctl.formats.dcp_container.write import (
    metadata_bytes,
    write_bytes_record,
    write_tensor_record,
)
from ckptctl.formats.torchsave.zip_writer import TensorSlot
from ckptctl.io.storage import Storage
from ckptctl.training.state import Item, Path, TensorItem


@dataclass
class Staged:
    """One item's bytes in host memory, as of the moment of the save."""

    fqn: str
    path: Path
    shape: tuple[int, ...] | None
    """Global shape (None for a value)."""
    offsets: tuple[int, ...] | None
    data: torch.Tensor | None = None
    """A contiguous CPU copy of the rank's box of a tensor."""
    payload: bytes | None = None
    """A value, already serialised with ``torch.save`` (training may change it meanwhile)."""
    write: bool = False
    """This rank stores it."""

    @property
    def dtype(self) -> str:
        assert self.data is not None
        return str(self.data.dtype).removeprefix("torch.")


def stage(
    items: dict[str, Item], mine: set[str], buffers: dict[str, Staged], keep_all: bool
) -> dict[str, Staged]:
    """Copy what this rank stores (everything it holds when ``keep_all``, for an in-memory
    copy) to host memory, reusing last save's buffers where shapes and dtypes still match:
    the only part of a save the training loop waits for."""
    staged: dict[str, Staged] = {}
    for fqn, item in items.items():
        if fqn not in mine and not keep_all:
            continue
        if isinstance(item, TensorItem):
            old = buffers.get(fqn)
            src = item.local.detach()
            if old is not None and old.data is not None and _same(old.data, src):
                data = old.data
            else:
                data = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=_pin(src))
            data.copy_(src, non_blocking=src.device.type != "cpu")
            staged[fqn] = Staged(fqn, item.path, item.shape, item.offsets, data=data)
        else:
            buf = io.BytesIO()
            torch.save(item.value, buf)
            staged[fqn] = Staged(fqn, item.path, None, None, payload=buf.getvalue())
        staged[fqn].write = fqn in mine
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


def _same(buffer: torch.Tensor, src: torch.Tensor) -> bool:
    return buffer.shape == src.shape and buffer.dtype == src.dtype


def _pin(src: torch.Tensor) -> bool:
    """Pinned host memory makes device-to-host copies asynchronous; CPU tensors need none."""
    return src.device.type == "cuda"


@dataclass
class RankResult:
    """What one rank wrote, sent to rank 0."""

    rank: int
    file: str | None = None
    size: int = 0
    checksum: str = ""
    tensors: list[dict[str, Any]] = field(default_factory=list)
    values: list[dict[str, Any]] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    """Every name this rank holds (rank 0 checks that each was stored by some rank)."""


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def write_rank(
    storage: Storage, rank: int, staged: dict[str, Staged], held: list[str]
) -> RankResult:
    """Stream the items this rank stores into its ``.distcp`` file, record by record, straight
    from the staged memory (no further copy); ``held`` names everything the rank holds."""
    result = RankResult(rank, held=held)
    mine = [s for s in staged.values() if s.write]
    if not mine:
        return result
    name = rank_file(rank)
    with storage.open_write(name, xxhash.xxh3_64()) as out:
        for s in mine:
            if s.data is None:
                assert s.payload is not None
                info = write_bytes_record(out, name, s.payload)
                result.values.append({"fqn": s.fqn, "path": list(s.path), **_at(info)})
                continue
            data = s.data
            slot = TensorSlot("0", s.dtype, tuple(data.shape))
            body = raw_bytes(from_torch(data))
            info = write_tensor_record(out, name, slot, partial(_once, body))
            result.tensors.append(
                {
                    "fqn": s.fqn,
                    "path": list(s.path),
                    "dtype": s.dtype,
                    "shape": list(s.shape or ()),
                    "offsets": list(s.offsets or ()),
                    "sizes": list(data.shape),
                    **_at(info),
                }
            )
    storage.drain()  # on the device before rank 0 can vouch for it
    result.file, result.size, result.checksum = name, out.size, out.digest.hexdigest()
    return result


def _at(info: StorageInfo) -> dict[str, Any]:
    return {"offset": info.offset, "length": info.length}


def begin(storage: Storage, checkpoint_id: str) -> None:
    """Rank 0, before any rank writes: mark the directory incomplete (a previous complete
    checkpoint at the same place stops being one before its files are replaced)."""
    storage.begin_writing()
    storage.write_text(
        INCOMPLETE, json.dumps({"operation": "save", "checkpoint_id": checkpoint_id})
    )
    for stale in (MANIFEST, METADATA_FILE):
        storage.remove(stale)


def commit(
    storage: Storage, checkpoint_id: str, results: list[RankResult], step: int | None = None
) -> dict[str, Any]:
    """Rank 0, once every rank has written: ``.metadata``, then the manifest, then the marker
    goes. Refuses (leaving the checkpoint incomplete) when the ranks' parts do not add up."""
    md = _metadata(checkpoint_id, results)
    missing = sorted({n for r in results for n in r.held} - set(md.entries))
    if missing:
        raise CheckpointError(
            f"save to {checkpoint_id}: no rank stored {', '.join(missing[:5])} (ranks passed "
            "state dicts with different entries); the checkpoint was not marked complete"
        )
    body = metadata_bytes(md)
    with storage.open_write(METADATA_FILE, xxhash.xxh3_64()) as out:
        out.write(body)
    files = {r.file: {"size": r.size, "checksum": r.checksum} for r in results if r.file}
    files[METADATA_FILE] = {"size": out.size, "checksum": out.digest.hexdigest()}
    storage.drain()
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "tool": f"ckptctl {__version__}",
        "operation": "save",
        "format": "dcp",
        "checkpoint_id": checkpoint_id,
        "world": len(results),
        "step": step,
        "checksum": "xxh3_64",
        "files": dict(sorted(files.items())),
        "tensors": {},
    }
    storage.write_text(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    storage.remove(INCOMPLETE)
    return manifest


def _metadata(checkpoint_id: str, results: list[RankResult]) -> DcpMetadata:
    chunks: dict[str, list[Chunk]] = {}
    geometry: dict[str, tuple[str, tuple[int, ...]]] = {}
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    entries: dict[str, TensorEntry | BytesEntry] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    for r in sorted(results, key=lambda r: r.rank):
        assert r.file is not None or not (r.tensors or r.values)
        for t in r.tensors:
            offsets = tuple(t["offsets"])
            chunks.setdefault(t["fqn"], []).append(Chunk(offsets=offsets, sizes=tuple(t["sizes"])))
            geometry[t["fqn"]] = (t["dtype"], tuple(t["shape"]))
            storage[(t["fqn"], offsets)] = StorageInfo(
                relative_path=str(r.file), offset=t["offset"], length=t["length"]
            )
            paths[t["fqn"]] = tuple(t["path"])
        for v in r.values:
            entries[v["fqn"]] = BytesEntry()
            storage[(v["fqn"], None)] = StorageInfo(
                relative_path=str(r.file), offset=v["offset"], length=v["length"]
            )
            paths[v["fqn"]] = tuple(v["path"])
    for fqn, found in chunks.items():
        dtype, shape = geometry[fqn]
        entries[fqn] = TensorEntry(dtype=dtype, shape=shape, chunks=tuple(found))
    return DcpMetadata(
        entries=entries,
        storage=storage,
        planner_data=paths,
        save_info=SaveInfo(checkpoint_id=checkpoint_id, save_id=uuid.uuid4().hex),
        version=DCP_VERSION,
    )


def _once(body: memoryview, _: TensorSlot) -> Iterator[memoryview]:
    """A record's bytes, already in memory, as the one chunk ``write_tensor_record`` streams."""
    yield body
