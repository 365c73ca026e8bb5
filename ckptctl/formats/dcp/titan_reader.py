"""The stored tensors of a torchtitan Llama 3 DCP checkpoint, placed in the canonical ones.

Each chunk of a tensor whose rows are in Meta's interleaved rotary order is declared with its
rows in HF order (``rotary_rows``): the reader gathers them when it reads the chunk, and the
pieces are cut from the chunk's runs of HF rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.formats.dcp.files import files_of
from ckptctl.formats.dcp.metadata import DcpMetadata, StorageInfo, TensorEntry
from ckptctl.formats.dcp.titan_layout import OPTIMIZER_PREFIX, TitanKey, key_table, unsupported
from ckptctl.model.geometry import Piece, chunk_pieces
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.rotary_rows import RotaryRows, hf_runs
from ckptctl.model.stored import CheckpointView, Format, KeyPath, Shape, StoredTensor

RowOrders = dict[KeyPath, tuple[RotaryRows, int, int]]
"""Chunks read through a row map: ``(order, first stored row, rows)`` by key."""


@dataclass
class TitanTensors:
    placed: list[tuple[StorageInfo, StoredTensor]] = field(default_factory=list)
    rows: RowOrders = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    has_optimizer: bool = False


def titan_view(
    where: str, base: str, metadata: DcpMetadata, iteration: int | None, spec: ModelSpec
) -> tuple[CheckpointView, RowOrders]:
    """The checkpoint's view under the configured model, and the chunks read row-mapped."""
    missing = unsupported(spec)
    if missing is not None:
        raise LayoutError(
            f"{where}: ckptctl maps torchtitan's Llama 3 names, but the given config has "
            f"{missing}; convert with --format torch (names kept) instead"
        )
    found = titan_tensors(metadata, spec)
    if found.problems:
        more = len(found.problems) - 5
        shown = "; ".join(found.problems[:5]) + (f" and {more} more" if more > 0 else "")
        raise CheckpointError(f"{where}: {shown}")
    view = CheckpointView(
        Format.DCP,
        spec,
        ParallelLayout(),
        files_of(base, found.placed),
        iteration,
        found.has_optimizer,
        ("torchtitan DCP checkpoint of a Llama model (q/k rows in Meta's rotary order)",),
    )
    return view, found.rows


def titan_tensors(metadata: DcpMetadata, spec: ModelSpec) -> TitanTensors:
    table = key_table(spec)
    out = TitanTensors()
    for fqn, entry in metadata.entries.items():
        if not isinstance(entry, TensorEntry):
            continue
        key = table.get(fqn)
        if key is None:
            out.problems.append(f"{fqn} is not a parameter (or Adam state) of the configured model")
            continue
        if entry.shape != key.shape:
            want = list(key.shape)
            out.problems.append(f"{fqn} has shape {list(entry.shape)}; config says {want}")
            continue
        out.has_optimizer |= fqn.startswith(OPTIMIZER_PREFIX)
        for chunk in entry.chunks:
            where: KeyPath = (fqn, *chunk.offsets)
            pieces = _chunk_pieces(key, chunk.offsets, chunk.sizes)
            tensor = StoredTensor(where, key.canonical, chunk.sizes, entry.dtype, pieces)
            if key.rows is not None:
                out.rows[where] = (key.rows, chunk.offsets[0], chunk.sizes[0])
            out.placed.append((metadata.storage[(fqn, chunk.offsets)], tensor))
    return out


def _chunk_pieces(key: TitanKey, offsets: Shape, sizes: Shape) -> tuple[Piece, ...]:
    """The chunk's pieces: for interleaved rows, those of each run of HF rows it holds, at the
    run's local rows."""
    if key.rows is None:
        return chunk_pieces(key.pieces, offsets, sizes)
    out: list[Piece] = []
    for local, hf, rows in hf_runs(key.rows, offsets[0], sizes[0]):
        run = chunk_pieces(key.pieces, (hf, *offsets[1:]), (rows, *sizes[1:]))
        out.extend(Piece((p.local[0] + local, *p.local[1:]), p.canonical, p.sizes) for p in run)
    return tuple(out)
