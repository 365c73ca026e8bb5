"""``ckptctl.load``: fill a rank's state dict in place, reading only the byte ranges it needs.

The planner (``planners.load``) decides from the template's boxes and the stored chunks
whether this rank reads its own shards directly, assembles its boxes from another layout's
chunks, or cuts them from a full checkpoint because shard files are lost; the decision and its
reason are logged and returned. Bytes go straight into the template's tensors where the record
lays them out as the tensor does (one read, no intermediate copy).
"""

from __future__ import annotations

import contextlib
import io
import logging
import posixpath
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptctl.arrays import from_torch
from ckptctl.checksums.manifest import INCOMPLETE
from ckptctl.checksums.record_checks import RecordChecks
from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_container.checkpoint import DcpCheckpoint, open_dcp
from ckptctl.formats.dcp_container.files import read_metadata_and_lost
from ckptctl.formats.dcp_container.metadata import (
    METADATA_FILE,
    BytesEntry,
    DcpMetadata,
    TensorEntry,
)
from ckptctl.formats.torchsave.archive import TensorRef
from ckptctl.formats.torchsave.refs import open_torch_file
from ckptctl.io.storage import Storage
from ckptctl.settings import StorageConfig
from ckptctl.training.saving import Staged
from planners.load import (
    FULL,
    LoadDecision,
    Need,
    Read,
    StoredChunk,
    StoredTensor,
    plan_load,
)

from .state import Leaf, TensorItem, flatten, is_stateful, items_of, resolve_stateful

log = logging.getLogger("ckptctl")


@dataclass
class LoadReport:
    checkpoint_id: str
    strategy: str
    """``direct``, ``reshard``, ``from-full`` or ``memory``."""
    reason: str
    files: list[str] = field(default_factory=list)
    """Files this rank read (``full:`` marks those of the full checkpoint)."""
    bytes_read: int = 0
    bytes_by_file: dict[str, int] = field(default_factory=dict)
    """Bytes read from each file (tensor records; values are small and not counted)."""
    read_for_record_checks: dict[str, int] = field(default_factory=dict)
    """Records this rank read bytes of for their CRC-32 checks, and those bytes: the bytes no
    rank read (``records``, ``bytes``)."""
    seconds: float = 0.0


ReadBox = Callable[[Read, np.ndarray | None], np.ndarray]
"""Reads a planned box (into the given array when the record allows it)."""


class _Sharded:
    """A DCP checkpoint as the planner sees it, and its records' reader."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        marker = storage.exists(INCOMPLETE)
        if marker or not storage.exists(METADATA_FILE):
            why = f"{INCOMPLETE} is present" if marker else f"it has no {METADATA_FILE}"
            raise CheckpointError(
                f"{storage.url} is not a complete checkpoint ({why}): its save never "
                "finished; load the previous one"
            )
        md, short = read_metadata_and_lost(storage, "")
        self.metadata: DcpMetadata = md
        self.lost = frozenset(short)
        self.reader: DcpCheckpoint = open_dcp(storage, "", md)

    def tensors(self) -> dict[str, StoredTensor]:
        md, out = self.metadata, {}
        for fqn, entry in md.entries.items():
            if isinstance(entry, TensorEntry):
                chunks = tuple(
                    StoredChunk(c.offsets, c.sizes, md.storage[(fqn, c.offsets)].relative_path)
                    for c in entry.chunks
                )
                out[fqn] = StoredTensor(entry.dtype, entry.shape, chunks)
        return out

    def read(self, read: Read, into: np.ndarray | None) -> np.ndarray:
        return self.reader.read_box(read.fqn, read.chunk.offsets, read.chunk_start, read.size, into)

    def value_file(self, fqn: str) -> str:
        entry = self.metadata.entries.get(fqn)
        if not isinstance(entry, BytesEntry):
            raise CheckpointError(f"{self.storage.url}: {fqn}: not in the checkpoint")
        return self.metadata.storage[(fqn, None)].relative_path

    def value(self, fqn: str) -> Any:
        self.value_file(fqn)  # refuses a name that is not a stored value
        info = self.metadata.storage[(fqn, None)]
        data = self.storage.read_range(info.relative_path, info.offset, info.length)
        return safe_value(data, f"{self.storage.describe(info.relative_path)} ({fqn})")


class _TorchFile:
    """A full checkpoint saved as one ``torch.save`` state dict (``consolidate --format
    torch``): each tensor is one chunk, named as DCP flattens the same nested state dict."""

    def __init__(self, storage: Storage, rel: str) -> None:
        self.storage, self.rel = storage, rel
        self.reader = open_torch_file(storage, rel)
        leaves = flatten(self.reader.tree, tensor=TensorRef)
        self.refs = {k: v.value for k, v in leaves.items() if isinstance(v.value, TensorRef)}
        self.values = {k: v.value for k, v in leaves.items() if k not in self.refs}

    def tensors(self) -> dict[str, StoredTensor]:
        return {
            fqn: StoredTensor(
                ref.dtype.name,
                ref.shape,
                (StoredChunk((0,) * len(ref.shape), ref.shape, self.rel),),
            )
            for fqn, ref in self.refs.items()
        }

    def read(self, read: Read, into: np.ndarray | None) -> np.ndarray:
        return self.reader.read(self.refs[read.fqn], read.chunk_start, read.size, into)

    def value(self, fqn: str) -> Any:
        if fqn not in self.values:
            raise CheckpointError(f"{self.reader.where}: {fqn}: not in the full checkpoint")
        return self.values[fqn]


def safe_value(data: bytes, where: str) -> Any:
    """A stored value through torch's restricted unpickler (tensors, containers, numbers and
    strings; nothing that runs code)."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"{where}: value refused by the safe unpickler ({str(err).splitlines()[0]}); if you "
            "trust the checkpoint, allow its classes with torch.serialization.add_safe_globals"
        ) from None


def _open_full(url: str, config: StorageConfig, checks: RecordChecks) -> _Sharded | _TorchFile:
    storage = Storage(url, config, read_only=True, checks=checks)
    if storage.isdir():
        return _Sharded(storage)
    parent, name = posixpath.split(url.rstrip("/"))
    return _TorchFile(Storage(parent or ".", config, read_only=True, checks=checks), name)


def load_into(
    state_dict: dict[str, Any],
    checkpoint_id: str,
    config: StorageConfig,
    *,
    full: str | None = None,
    memory: Mapping[str, Staged] | None = None,
    gather: Callable[[Any], list[Any]] = lambda obj: [obj],
    rank: int = 0,
) -> LoadReport:
    """``gather``: every rank's value in rank order (the ranks' own process group); each rank
    calls ``load_into``, and all fail together (the records they read in parts are checked
    together, and one rank's failure fails the others instead of leaving them waiting)."""
    start = time.perf_counter()
    checks = RecordChecks()  # this load's own: its records are checked together, then dropped
    records_before, bytes_before = checks.read_again()
    resolved = resolve_stateful(state_dict)
    leaves = flatten(resolved)
    items = items_of(resolved)
    tensors = {k: v for k, v in items.items() if isinstance(v, TensorItem)}
    needs = [Need(k, t.dtype, t.shape, t.offsets, tuple(t.local.shape)) for k, t in tensors.items()]
    try:
        if memory is not None and _memory_matches(needs, leaves, memory):
            checked: list[str] = []  # nothing read from storage: no records to check
            report = _from_memory(checkpoint_id, tensors, leaves, memory)
        else:
            report, checked = _from_storage(
                checkpoint_id, config, full, needs, tensors, leaves, checks
            )
    except Exception as err:
        with contextlib.suppress(Exception):  # the error to raise is this one, whatever else
            checks.settle_across([], gather, rank, f"{type(err).__name__}: {err}")
        raise
    _agree(checked, gather, rank, checks)
    records_after, bytes_after = checks.read_again()
    report.read_for_record_checks = {
        "records": records_after - records_before,
        "bytes": bytes_after - bytes_before,
    }
    for key, value in list(state_dict.items()):
        if is_stateful(value):
            value.load_state_dict(resolved[key])
        else:  # a top-level value was replaced in the resolved copy
            state_dict[key] = resolved[key]
    report.seconds = time.perf_counter() - start
    log.info("ckptctl: load %s: %s (%s)", checkpoint_id, report.strategy, report.reason)
    return report


def _from_storage(
    checkpoint_id: str,
    config: StorageConfig,
    full: str | None,
    needs: list[Need],
    tensors: dict[str, TensorItem],
    leaves: dict[str, Leaf],
    checks: RecordChecks,
) -> tuple[LoadReport, list[str]]:
    """The load from files, and the files whose records it read (to be checked)."""
    sharded = _Sharded(Storage(checkpoint_id, config, read_only=True, checks=checks))
    stored = sharded.tensors()
    fallback = _open_full(full, config, checks) if full and sharded.lost else None
    decision = plan_load(needs, stored, sharded.lost, fallback.tensors() if fallback else None)
    if decision.problems:
        more = f" (and {len(decision.problems) - 1} more)" if len(decision.problems) > 1 else ""
        hint = " (pass full= a full checkpoint of the same step)" if sharded.lost else ""
        raise CheckpointError(f"{checkpoint_id}: {decision.problems[0]}{more}{hint}")
    by_file = _fill(decision, tensors, {"sharded": sharded.read, FULL: _reader(fallback)})
    for fqn, leaf in leaves.items():
        if fqn in tensors:
            continue
        file = sharded.value_file(fqn)
        if file not in sharded.lost:
            leaf.parent[leaf.key] = sharded.value(fqn)
        elif fallback is not None:
            leaf.parent[leaf.key] = fallback.value(fqn)
        else:
            raise CheckpointError(
                f"{checkpoint_id}: {fqn}: its file {file} is lost (pass "
                "full= a full checkpoint of the same step)"
            )
    files = [f"{s}:{f}" if s == FULL else f for s, f in decision.files]
    report = LoadReport(checkpoint_id, decision.strategy, decision.reason, files)
    report.bytes_by_file = by_file
    report.bytes_read = sum(by_file.values())
    # A rank reads its part of records stored whole (a full file's tensors, another world
    # size's shards): ``_agree`` has them checked against their CRC-32s.
    checked = [sharded.storage.checked_name(f) for s, f in decision.files if s != FULL]
    if isinstance(fallback, _TorchFile):
        checked.append(fallback.storage.checked_name(fallback.rel))
    elif fallback is not None:
        checked += [fallback.storage.checked_name(f) for s, f in decision.files if s == FULL]
    return report, checked


def _agree(
    checked: list[str], gather: Callable[[Any], list[Any]], rank: int, checks: RecordChecks
) -> None:
    """Check the records the ranks read in parts, together; raise the first failure of any
    rank (this rank's own first), on every rank."""
    failures = checks.settle_across(checked, gather, rank)
    own = failures[rank]
    if own is not None:
        raise CheckpointError(own)
    other = next(((r, text) for r, text in enumerate(failures) if text is not None), None)
    if other is not None:
        raise CheckpointError(f"rank {other[0]} failed to load: {other[1]}")


def _reader(source: _Sharded | _TorchFile | None) -> ReadBox:
    def missing(read: Read, into: np.ndarray | None) -> np.ndarray:
        raise AssertionError("no full checkpoint to read from")

    return source.read if source is not None else missing


def _fill(
    decision: LoadDecision, tensors: dict[str, TensorItem], readers: dict[str, ReadBox]
) -> dict[str, int]:
    """Carry out the planned reads into the template's tensors; bytes read per file."""
    by_tensor: dict[str, list[Read]] = {}
    for r in decision.reads:
        by_tensor.setdefault(r.fqn, []).append(r)
    nbytes: dict[str, int] = {}
    for fqn, reads in by_tensor.items():
        local = tensors[fqn].local
        direct = local.device.type == "cpu" and local.is_contiguous()
        target = local if direct else torch.empty(local.shape, dtype=local.dtype)
        dest = from_torch(target.detach())
        for r in reads:
            box: tuple[Any, ...] = (
                *(slice(s, s + n) for s, n in zip(r.need_start, r.size, strict=True)),
                Ellipsis,
            )
            view = dest[box]  # a view even of a 0-d tensor
            got = readers[r.source](r, view if view.flags.c_contiguous else None)
            if got is not view:
                view[...] = got
            name = f"{r.source}:{r.chunk.file}" if r.source == FULL else r.chunk.file
            nbytes[name] = nbytes.get(name, 0) + got.nbytes
        if not direct:
            with torch.no_grad():
                local.copy_(target)
    return nbytes


def _memory_matches(
    needs: list[Need], leaves: dict[str, Leaf], memory: Mapping[str, Staged]
) -> bool:
    """The in-memory copy holds exactly this rank's boxes (same layout, same process)."""
    for need in needs:
        s = memory.get(need.fqn)
        if s is None or s.data is None or s.offsets != need.offsets or s.shape != need.shape:
            return False
        if tuple(s.data.shape) != need.sizes or s.dtype != need.dtype:
            return False
    return all(fqn in memory for fqn in leaves)


def _from_memory(
    checkpoint_id: str,
    tensors: dict[str, TensorItem],
    leaves: dict[str, Leaf],
    memory: Mapping[str, Staged],
) -> LoadReport:
    nbytes = 0
    with torch.no_grad():
        for fqn, leaf in leaves.items():
            staged = memory[fqn]
            if fqn in tensors:
                assert staged.data is not None
                tensors[fqn].local.copy_(staged.data)
                nbytes += staged.data.numel() * staged.data.element_size()
            else:
                assert staged.payload is not None
                leaf.parent[leaf.key] = safe_value(staged.payload, f"memory ({fqn})")
    reason = f"the last save of this process is held in memory: {len(leaves)} item(s) copied"
    return LoadReport(checkpoint_id, "memory", reason, [], nbytes)
