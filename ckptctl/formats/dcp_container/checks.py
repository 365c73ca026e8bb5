"""Checking what a DCP ``.metadata`` promises: every tensor's chunks in bounds, disjoint and
covering it, every record where a file can hold it. Pure."""

from __future__ import annotations

from math import prod

from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_container.metadata import (
    SUPPORTED_TRANSFORMS,
    Chunk,
    DcpMetadata,
    StorageInfo,
    StorageKey,
    TensorEntry,
)
from ckptctl.model.geometry import boxes_disjoint

_MAX_REPORTED = 20  # a broken checkpoint with 10^5 chunks should not produce a 10 MB message


# --- records -----------------------------------------------------------------------------------


def metadata_problems(md: DcpMetadata) -> list[str]:
    """Every way ``md`` fails to describe a readable checkpoint, as one-line messages.

    Per tensor: chunks of the right rank, in bounds, pairwise disjoint and together covering
    every element (torch's ``_validate_global_plan`` invariant); every chunk and byte item has a
    record; no record needs a stream transform ckptctl cannot undo.
    """
    problems: list[str] = []
    for fqn, entry in md.entries.items():
        if isinstance(entry, TensorEntry):
            problems += _tensor_problems(fqn, entry)
            keys: list[StorageKey] = [(fqn, c.offsets) for c in entry.chunks]
        else:
            keys = [(fqn, None)]
        for key in keys:
            problems += _record_problems(key, md.storage.get(key))
    return problems


def check_metadata(md: DcpMetadata, where: str) -> None:
    """Raise one ``CheckpointError`` listing every problem of ``md`` (see ``metadata_problems``)."""
    problems = metadata_problems(md)
    if problems:
        shown = "; ".join(problems[:_MAX_REPORTED])
        more = len(problems) - _MAX_REPORTED
        tail = f"; and {more} more" if more > 0 else ""
        raise CheckpointError(f"{where}: {len(problems)} problem(s): {shown}{tail}")


def _tensor_problems(fqn: str, entry: TensorEntry) -> list[str]:
    problems = []
    fitting = []
    for c in entry.chunks:
        if len(c.offsets) != len(entry.shape):
            problems.append(
                f"{fqn}: chunk {_box(c)} has rank {len(c.offsets)}, tensor has shape {entry.shape}"
            )
        elif any(o + s > n for o, s, n in zip(c.offsets, c.sizes, entry.shape, strict=True)):
            problems.append(f"{fqn}: chunk {_box(c)} lies outside shape {entry.shape}")
        else:
            fitting.append(c)
    overlaps = _overlaps(fitting)
    problems += [f"{fqn}: chunks {_box(a)} and {_box(b)} overlap" for a, b in overlaps]
    if len(fitting) == len(entry.chunks) and not overlaps:
        covered, total = sum(c.numel for c in fitting), prod(entry.shape)
        if covered != total:
            problems.append(f"{fqn}: chunks cover {covered} of {total} elements of {entry.shape}")
    return problems


def _overlaps(chunks: list[Chunk]) -> list[tuple[Chunk, Chunk]]:
    """Overlapping pairs. Sorted by offsets, a chunk can only meet later chunks that start
    before its end in dim 0, which keeps the usual tiling of thousands of chunks near-linear."""
    ordered = sorted(chunks, key=lambda c: c.offsets)
    pairs = []
    for i, a in enumerate(ordered):
        end0 = a.offsets[0] + a.sizes[0] if a.offsets else None
        for b in ordered[i + 1 :]:
            if end0 is not None and b.offsets[0] >= end0:
                break
            if not boxes_disjoint((a.offsets, a.sizes), (b.offsets, b.sizes)):
                pairs.append((a, b))
    return pairs


def _record_problems(key: StorageKey, info: StorageInfo | None) -> list[str]:
    fqn, offsets = key
    what = f"{fqn} chunk at {offsets}" if offsets is not None else f"{fqn} (byte item)"
    if info is None:
        return [f"{what}: no storage record"]
    unknown = [t for t in info.transform_descriptors if t not in SUPPORTED_TRANSFORMS]
    if unknown:
        return [
            f"{what}: record in {info.relative_path} uses stream transform(s) {unknown} "
            "(e.g. zstd compression) that ckptctl cannot undo; re-save without _extensions"
        ]
    return []


def _box(c: Chunk) -> str:
    return f"[offsets {c.offsets}, sizes {c.sizes}]"
