"""A reader of any DCP checkpoint's records: the view it was probed to (key by key, an HF model's
names, torchtitan's, megatron-core's sharded keys) and each chunk's ``torch.save`` record opened
lazily and read by byte range (exact ranged GETs on object stores). The formats stored as DCP
(``dcp``, ``torch_dist``) build their checkpoints on it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from functools import partial
from math import prod
from typing import TYPE_CHECKING, Any, ClassVar

from ckptctl.errors import CheckpointError
from ckptctl.formats.base import Checkpoint, SavedTraining, templates_of
from ckptctl.formats.dcp_container.files import chunks_placed, files_of, join
from ckptctl.formats.dcp_container.metadata import BytesEntry, DcpMetadata, StorageInfo, TensorEntry
from ckptctl.formats.dcp_container.records import (
    Fetch,
    RecordWindow,
    RemoteRecord,
    open_record,
    pread,
    tensor_of,
)
from ckptctl.formats.shifted_reads import ShiftedReads
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.formats.torchsave.refs import stored_object, view_ref
from ckptctl.io.runs import Span
from ckptctl.io.storage import Storage
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.megatron_style import TORCH_ADAM, MegatronStyle, OptimizerLayout
from ckptctl.model.rotary_rows import RotaryRows, stored_rows
from ckptctl.model.stored import (
    CheckpointView,
    FlatView,
    Format,
    KeyPath,
    Shape,
    StoredTensor,
)

if TYPE_CHECKING:
    import numpy as np

RowOrders = dict[KeyPath, tuple[RotaryRows, int, int]]
"""Chunks read through a row map (torchtitan's rotary q/k rows): ``(order, first stored row,
rows)`` by key."""


FLAT_GROUPS = "optimizer.param_groups."
"""Where a flattened optimizer state dict (torch's ``get_optimizer_state_dict`` with
``flatten_optimizer_state_dict``, as torchtitan saves it under ``optimizer``) keeps each
parameter's options: ``<this><parameter>.<option>``."""


def flattened_groups(items: dict[str, Any]) -> list[dict[str, Any]]:
    """torch's parameter groups from flattened ones (every parameter's options, keyed
    ``optimizer.param_groups.<parameter>.<option>``): each distinct set of options."""
    by_param: dict[str, dict[str, Any]] = {}
    for key, value in items.items():
        param, _, option = key[len(FLAT_GROUPS) :].rpartition(".")
        by_param.setdefault(param, {})[option] = value
    groups: list[dict[str, Any]] = []
    for options in by_param.values():
        if options not in groups:
            groups.append(options)
    return groups


@dataclass
class DcpCheckpoint(Checkpoint):
    """A probed DCP checkpoint: its view for planners and lazily opened records."""

    locates: ClassVar[bool] = True

    storage: Storage
    view: CheckpointView
    base: str
    """Directory (relative to the checkpoint root) holding ``.metadata``."""
    metadata: DcpMetadata
    _records: dict[tuple[str, tuple[int, ...]], tuple[TorchZipReader, TensorRef]] = field(
        default_factory=dict
    )
    _files: dict[str, Any] = field(default_factory=dict)
    row_orders: RowOrders = field(default_factory=dict)
    """Chunks whose rows are read through a row map (torchtitan's rotary q/k rows)."""
    rounding: bool = False
    """Round a shifted weight whose shift is not taken off exactly (``--allow-rounding``)."""
    blocks: dict[tuple[str, KeyPath], bool] = field(init=False, default_factory=dict)
    """Chunks of GPT-OSS's packed experts (by file and key), each block read turned to
    Megatron's orientation (and, where this says its gated halves are interleaved, its rows put
    apart): what the view declares (``StoredTensor.transposed`` / ``interleaved``)."""
    shifted: ShiftedReads = field(init=False, default_factory=ShiftedReads)
    """Chunks stored shifted from the canonical values (Qwen3.5's gated norms), read with the
    shift taken off, exactly or (``--allow-rounding``) rounded."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.blocks = {
            (file.path, t.key): t.interleaved
            for file in self.view.files
            for t in file.tensors
            if t.transposed or t.interleaved
        }
        self.shifted = ShiftedReads.of(self.view, self.rounding)

    def _open(self, fqn: str, offsets: tuple[int, ...]) -> tuple[TorchZipReader, TensorRef]:
        key = (fqn, offsets)
        with self._lock:
            if key not in self._records:
                info = self.metadata.storage.get(key)
                entry = self.metadata.entries.get(fqn)
                if info is None or not isinstance(entry, TensorEntry):
                    raise CheckpointError(f"{self.storage.url}: no record for {fqn} at {offsets}")
                sizes = next(c.sizes for c in entry.chunks if c.offsets == offsets)
                window, fetch, where = self._source(fqn, info)
                rel = join(self.base, info.relative_path)
                stored = stored_object(self.storage, rel)
                place = (rel, info.offset)
                checks = self.storage.checks
                reader = open_record(window, info, where, fetch, place, stored, checks)
                self._records[key] = (reader, tensor_of(reader, entry.dtype, sizes, where))
            return self._records[key]

    def _source(self, fqn: str, info: StorageInfo) -> tuple[Any, Fetch, str]:
        """A view of exactly the record ``info`` locates, a fetcher of its bytes, and its name
        (call under the lock)."""
        rel = join(self.base, info.relative_path)
        where = f"{self.storage.describe(rel)}@{info.offset} ({fqn})"
        if not self.storage.is_local:
            remote = RemoteRecord(self.storage, rel, info.offset, info.length)
            return remote, remote.fetch, where
        if rel not in self._files:
            self._files[rel] = self.storage.open_read(rel)
        f = self._files[rel]
        window = RecordWindow(f, info.offset, info.length)
        return window, partial(pread, f.fileno(), info.offset), where

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: Shape,
        sizes: Shape,
        view: FlatView = None,
        *,
        transposed: bool = False,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        block_of = self.blocks.get((path, key))
        if transposed and block_of is None:
            raise ValueError("DCP stores no tensor transposed but GPT-OSS's packed experts")
        reader, ref = self._open(str(key[0]), tuple(int(k) for k in key[1:]))
        if view is not None and block_of is not None:  # an expert's block, in Megatron's order
            from ckptctl.arrays import packed_block_box

            start, shape = view
            block = view_ref(_flat(ref), start, shape[::-1] if transposed else shape)
            return packed_block_box(
                lambda first, count: reader.read(block, first, count),
                offsets,
                sizes,
                shape[0],
                transposed,
                block_of,
            )
        if view is not None:
            ref = view_ref(_flat(ref), *view)
        if (path, key) in self.shifted:
            where = f"{self.storage.describe(self.base)}: {key[0]} at {list(key[1:])}"
            return self.shifted.unshifted((path, key), reader.read(ref, offsets, sizes), where)
        if key in self.row_orders:  # gather the rows, in HF order, from their stored run
            import numpy as np

            at = np.asarray(stored_rows(*self.row_orders[key], offsets[0], sizes[0]))
            lo = int(at.min())
            box = reader.read(ref, (lo, *offsets[1:]), (int(at.max()) + 1 - lo, *sizes[1:]))
            return np.ascontiguousarray(box[at - lo])
        return reader.read(ref, offsets, sizes)

    def where(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        """Where the box lies in its ``.distcp`` file, when it lies there contiguously."""
        if key in self.row_orders or (path, key) in self.blocks or (path, key) in self.shifted:
            return None
        reader, ref = self._open(str(key[0]), tuple(int(k) for k in key[1:]))
        if view is not None:
            ref = view_ref(_flat(ref), *view)
        return reader.span(ref, offsets, sizes)

    def read_box(
        self,
        fqn: str,
        chunk: tuple[int, ...],
        start: Shape,
        sizes: Shape,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        """Box ``[start, start + sizes)`` of the record of ``fqn``'s chunk at ``chunk``, read
        straight into ``into`` where the record lays the box out as ``into`` does."""
        reader, ref = self._open(fqn, chunk)
        return reader.read(ref, start, sizes, into)

    def record_windows(self, path: str) -> list[tuple[int, int]] | None:
        """Each record of a ``.distcp`` file is a zip archive of its own."""
        if not path.endswith(".distcp"):
            return None
        name = (
            path[len(self.base) + 1 :] if self.base and path.startswith(self.base + "/") else path
        )
        return sorted(
            {
                (i.offset, i.length)
                for i in self.metadata.storage.values()
                if i.relative_path == name
            }
        )

    def as_generic(self) -> DcpCheckpoint:
        """The same checkpoint read key by key, whatever model it holds."""
        if self.view.format == Format.DCP and self.view.spec is None and not self.view.hf_named:
            return self
        keyed = generic(self.storage, self.base, self.metadata, self.view.iteration)
        keyed.view = replace(keyed.view, layout=self.view.layout)  # as saved, for reports
        return keyed

    def key_path(self, fqn: str) -> tuple[Any, ...]:
        """Where ``fqn`` sits in the nested state dict the saver was given."""
        planner = self.metadata.planner_data or {}
        return tuple(planner.get(fqn, (fqn,)))

    def rounding_errors(self) -> dict[str, float]:
        """The largest error each shifted weight was rounded with (``--allow-rounding``)."""
        return self.shifted.errors

    def _saved_param_groups(self) -> list[dict[str, Any]]:
        """torch's ``param_groups`` as DCP saved them: one byte item per group option."""
        groups: dict[int, dict[str, Any]] = {}
        for fqn in self.byte_items():
            path = self.key_path(fqn)
            in_group = len(path) >= 3 and path[-3] == "param_groups"
            if in_group and isinstance(path[-2], int) and path[-1] != "params":
                groups.setdefault(path[-2], {})[str(path[-1])] = self.byte_item(fqn)[0]
        if not groups:  # a flattened optimizer (torchtitan's): each parameter's options
            flat = [f for f in self.byte_items() if f.startswith(FLAT_GROUPS)]
            return flattened_groups({f: self.byte_item(f)[0] for f in flat})
        return [groups[i] for i in sorted(groups)]

    def byte_items(self) -> list[str]:
        return [k for k, e in self.metadata.entries.items() if isinstance(e, BytesEntry)]

    @property
    def optimizer(self) -> OptimizerLayout | None:
        """An HF model under torch's Adam (FSDP2): per-parameter step and moments, the fp32
        weights their own masters, as Megatron's FP32Optimizer stores them."""
        if not self.view.has_optimizer or self.view.spec is None:
            return None
        return TORCH_ADAM

    @property
    def style(self) -> MegatronStyle:
        return MegatronStyle(optimizer=self.optimizer)

    def saved_training(self, path: str) -> SavedTraining:
        """An HF model's DCP checkpoint keeps only its optimizer's parameter-group settings."""
        return SavedTraining(templates=self.group_templates())

    def group_templates(self) -> dict[bool, dict[str, Any]]:
        """Each parameter group's settings by kind (True: no weight decay), as torch's
        ``param_groups`` were saved (Adam's step aside)."""
        groups = self._saved_param_groups()
        if len(groups) == 1:  # one group for every parameter: both kinds share it
            return {kind: dict(groups[0]) for kind in (False, True)}
        return templates_of(groups)

    def byte_item(self, fqn: str) -> tuple[Any, TorchZipReader]:
        """A non-tensor item (e.g. an optimizer hyperparameter) and its record's reader (for
        tensors inside it), through the restricted unpickler: torch's own loader would run
        arbitrary pickles here."""
        info = self.metadata.storage.get((fqn, None))
        if info is None:
            raise CheckpointError(f"{self.storage.url}: no record for item {fqn}")
        with self._lock:
            window, fetch, where = self._source(fqn, info)
            reader = open_record(window, info, where, fetch, checks=self.storage.checks)
        return reader.tree, reader


def _flat(ref: TensorRef) -> TensorRef:
    """A contiguous record tensor viewed as 1-D (layer slices are views into it)."""
    return TensorRef(ref.storage, ref.offset, (prod(ref.shape),), (1,))


def open_dcp(storage: Storage, base: str, metadata: DcpMetadata) -> DcpCheckpoint:
    """A reader of any DCP checkpoint's records, key by key (``metadata`` already checked)."""
    return generic(storage, base, metadata, None)


def generic(
    storage: Storage, base: str, metadata: DcpMetadata, iteration: int | None
) -> DcpCheckpoint:
    """Each key its own canonical tensor, chunk by chunk."""
    placed: list[tuple[StorageInfo, StoredTensor]] = []
    for fqn, entry in metadata.entries.items():
        if isinstance(entry, TensorEntry):
            placed += chunks_placed(metadata, fqn, entry, fqn)
    items = sum(isinstance(e, BytesEntry) for e in metadata.entries.values())
    view = CheckpointView(
        Format.DCP,
        None,
        ParallelLayout(),
        files_of(base, placed),
        iteration,
        any(".state." in k or k.startswith("optim") for k in metadata.entries),
        (f"PyTorch DCP checkpoint: {len(metadata.entries) - items} tensors, {items} other items",),
    )
    return DcpCheckpoint(storage, view, base, metadata)
