"""The stored tensors of a torchtitan Llama 3 DCP checkpoint, placed in the canonical ones.

Each chunk of a tensor whose rows are in Meta's interleaved rotary order is declared with its
rows in HF order (``rotary_rows``): the reader gathers them when it reads the chunk, and the
pieces are cut from the chunk's runs of HF rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.formats.dcp.titan_layout import (
    ANCHOR,
    EXPERT_BIAS,
    OPTIMIZER_PREFIX,
    OUTPUT_NAMES,
    TitanKey,
    key_table,
    titan_entries,
    unsupported,
)
from ckptctl.formats.dcp_container.checkpoint import RowOrders
from ckptctl.formats.dcp_container.files import files_of, join
from ckptctl.formats.dcp_container.metadata import DcpMetadata, StorageInfo, TensorEntry
from ckptctl.model.geometry import Piece, chunk_pieces
from ckptctl.model.hf_families import choose_family
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.rotary_rows import hf_runs
from ckptctl.model.stored import CheckpointView, Format, KeyPath, Replica, Shape, StoredTensor


@dataclass
class TitanTensors:
    placed: list[tuple[StorageInfo, StoredTensor]] = field(default_factory=list)
    rows: RowOrders = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    biases: list[str] = field(default_factory=list)
    """torchtitan's load-balancing expert biases (routing only, no HF counterpart)."""
    held: set[str] = field(default_factory=set)
    """The HF weights the model's keys hold."""
    replicas: list[Replica] = field(default_factory=list)
    """A tied model's output layer: the embedding again, checked equal, not read."""
    has_optimizer: bool = False


def titan_view(
    where: str,
    base: str,
    metadata: DcpMetadata,
    iteration: int | None,
    spec: ModelSpec,
    read: Callable[..., Any],
) -> tuple[CheckpointView, RowOrders]:
    """The checkpoint's view under the configured model, and the chunks read row-mapped;
    ``read``: the checkpoint's reader of boxes (torchtitan's expert biases are checked zero)."""
    missing = unsupported(spec)
    if missing is not None:
        raise LayoutError(
            f"{where}: ckptctl maps torchtitan's Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3 and "
            "GPT-OSS names, but the "
            f"given config has {missing}; convert with --format torch (names kept) instead"
        )
    found = titan_tensors(metadata, spec, base)
    for fqn in found.biases:  # HF's Qwen3-MoE routes without one: only zeros may be left out
        entry = metadata.entries[fqn]
        assert isinstance(entry, TensorEntry)  # titan_tensors found it among the tensors
        zero = (0,) * len(entry.shape)
        values = [read("", (fqn, *c.offsets), zero, c.sizes).reshape(-1) for c in entry.chunks]
        if any(float(v) != 0.0 for chunk in values for v in chunk):
            found.problems.append(
                f"{fqn} (torchtitan's load-balancing expert bias) is not zero, and "
                f"{choose_family(spec).architecture} routes without one: converting would "
                "change which experts each token takes"
            )
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
        (
            f"torchtitan DCP checkpoint of a {choose_family(spec).architecture}"
            + (f" ({len(found.biases)} expert biases, all zero, left out)" if found.biases else ""),
        ),
        replicas=tuple(found.replicas),
    )
    return view, found.rows


def titan_tensors(metadata: DcpMetadata, spec: ModelSpec, base: str) -> TitanTensors:
    table = key_table(spec)
    out = TitanTensors()
    for fqn, entry in metadata.entries.items():
        if not isinstance(entry, TensorEntry):
            continue
        key = table.get(fqn)
        if key is None and fqn.endswith(EXPERT_BIAS) and spec.is_moe:
            out.biases.append(fqn)
            continue
        if key is None and fqn in OUTPUT_NAMES and spec.tie_embeddings:
            out.replicas.extend(_tied_copies(metadata, base, fqn, out.problems))
            continue
        if key is None:
            out.problems.append(f"{fqn} is not a parameter (or Adam state) of the configured model")
            continue
        if entry.shape != key.shape:
            want = list(key.shape)
            out.problems.append(f"{fqn} has shape {list(entry.shape)}; config says {want}")
            continue
        out.has_optimizer |= fqn.startswith(OPTIMIZER_PREFIX)
        out.held.update(key.hf)
        for chunk in entry.chunks:
            where: KeyPath = (fqn, *chunk.offsets)
            info = metadata.storage[(fqn, chunk.offsets)]
            if key.experts:
                out.placed.extend((info, t) for t in _expert_views(key, where, chunk, entry.dtype))
                if key.rows is not None:  # each expert's rows interleaved (GPT-OSS's GLU)
                    if any(chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != key.shape[1:]:
                        out.problems.append(f"{fqn} is saved cut inside an expert's matrix")
                    out.rows[where] = (key.rows, 0, key.shape[1])
                continue
            pieces = _chunk_pieces(key, chunk.offsets, chunk.sizes)
            tensor = StoredTensor(where, key.canonical, chunk.sizes, entry.dtype, pieces)
            if key.rows is not None:
                out.rows[where] = (key.rows, chunk.offsets[0], chunk.sizes[0])
            out.placed.append((info, tensor))
    _check_held(out, spec)
    return out


def _check_held(out: TitanTensors, spec: ModelSpec) -> None:
    """Every weight of the configured model held (a config of another model may name
    tensors the checkpoint lacks: say which, as HF names them)."""
    missing = list(dict.fromkeys(hf for hf, *_ in titan_entries(spec) if hf not in out.held))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        out.problems.append(
            f"no tensor holds the configured model's {', '.join(missing[:3])}{more} (HF "
            "names): is the config this run's?"
        )


def _tied_copies(metadata: DcpMetadata, base: str, fqn: str, problems: list[str]) -> list[Replica]:
    """The output layer a tied model saves beside its embedding (the same tensor, sharded
    alike), chunk by chunk."""
    kept, copy = metadata.entries.get(ANCHOR), metadata.entries[fqn]
    assert isinstance(copy, TensorEntry)
    boxes = [(c.offsets, c.sizes) for c in copy.chunks]
    if not isinstance(kept, TensorEntry) or [(c.offsets, c.sizes) for c in kept.chunks] != boxes:
        problems.append(f"{fqn} should be {ANCHOR} (the config ties them) but is stored apart")
        return []
    out = []
    for offsets, sizes in boxes:
        original = metadata.storage[(ANCHOR, offsets)]
        duplicate = metadata.storage[(fqn, offsets)]
        out.append(
            Replica(
                join(base, original.relative_path),
                (ANCHOR, *offsets),
                sizes,
                join(base, duplicate.relative_path),
                (fqn, *offsets),
            )
        )
    return out


def _expert_views(key: TitanKey, where: KeyPath, chunk: Any, dtype: str) -> list[StoredTensor]:
    """A chunk of a grouped experts tensor as each expert's part of it: a contiguous run of
    the chunk's elements (a view), placed in that expert's canonical tensor. A grouped
    parameter's Adam step (0-d) counts for every expert."""
    if not key.shape:
        return [StoredTensor(where, c, (), dtype, pieces) for c, pieces in key.experts]
    first, *inner_offsets = chunk.offsets
    count, *inner = chunk.sizes
    size = prod(inner)
    out = []
    for k in range(count):
        canonical, pieces = key.experts[first + k]
        kept = chunk_pieces(pieces, tuple(inner_offsets), tuple(inner))
        view = StoredTensor(where, canonical, tuple(inner), dtype, kept, view_offset=k * size)
        out.append(view)
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
