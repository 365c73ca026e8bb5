"""Plan a conversion: fill every target tensor from the source pieces that overlap it.

Each target piece is covered greedily by source pieces of the same canonical tensor, skipping
any that would cover an element twice (TP-replicated norms and tied-embedding copies are held by
several files; one is enough). Source holders are tried in a deterministic order that prefers
the file with the target's own TP rank, so replicated tensors are read from different files
rather than all from rank 0.
"""

from __future__ import annotations

from collections import defaultdict
from math import prod
from typing import TypedDict

from ckptctl.errors import CheckpointError
from ckptctl.model.geometry import Piece, Shape, box_difference, nbytes, overlap
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.plan import CopyOp, Estimates, FileWrite, TensorWrite
from ckptctl.model.stored import CheckpointView, StoredFile, StoredTensor
from ckptctl.model.target import TargetFiles, TargetPlanner

Found = tuple[int, Shape, Shape, Shape]
"""(candidate position, source offsets, target offsets, sizes)."""


def _cover(
    pieces: tuple[Piece, ...],
    prefer: tuple[bool, ...],
    held_pieces: tuple[tuple[Piece, ...], ...],
) -> tuple[list[Found], bool]:
    """Copies filling ``pieces`` from the candidates' pieces, preferred candidates first; only
    the part no earlier candidate gave is taken (replicas and full copies overlap what survives).
    Returns the copies and whether every element was covered."""
    order = sorted(range(len(held_pieces)), key=lambda c: (prefer[c], c))
    found: list[Found] = []
    complete = True
    for piece in pieces:
        need = piece.numel
        taken: list[tuple[Shape, Shape]] = []
        for position in order:
            for held_piece in held_pieces[position]:
                if need == 0:
                    break
                copy = overlap(piece, held_piece)
                if copy is None:
                    continue
                start = tuple(
                    c + d - lo
                    for c, d, lo in zip(piece.canonical, copy.dst, piece.local, strict=True)
                )
                for offsets, sizes in box_difference((start, copy.sizes), taken):
                    shift = tuple(o - s for o, s in zip(offsets, start, strict=True))
                    taken.append((offsets, sizes))
                    found.append(
                        (
                            position,
                            tuple(a + d for a, d in zip(copy.src, shift, strict=True)),
                            tuple(a + d for a, d in zip(copy.dst, shift, strict=True)),
                            sizes,
                        )
                    )
                    need -= prod(sizes)
        complete = complete and need == 0
    return found, complete


def _holders_of(
    canonical: str, holders: dict[str, list[tuple[int, StoredTensor]]]
) -> list[tuple[int, StoredTensor]]:
    """Who holds ``canonical``; an fp32 weight is its own master copy (Megatron's
    ``FP32Optimizer`` keeps no separate fp32 params)."""
    found = holders.get(canonical)
    if not found and canonical.startswith("fp32_param/"):
        weights = holders.get(canonical.split("/", 1)[1], [])
        found = [(i, t) for i, t in weights if t.dtype == "float32"]
    return found or []


def plan_files(
    source: CheckpointView,
    targets: tuple[StoredFile, ...],
    kind: str,
    *,
    carry_from: int | None = None,
    flat_kind: str | None = None,
) -> tuple[tuple[FileWrite, ...], Estimates]:
    """Copy operations for every tensor of ``targets`` out of ``source``'s files, each
    written as ``kind`` (files of flat buffers as ``flat_kind``)."""
    holders: dict[str, list[tuple[int, StoredTensor]]] = defaultdict(list)
    # Copies of one box in files of the same TP rank (a dense tensor in every EP rank's file)
    # are alike to the cover below, which takes the first: only the first is kept, so a
    # tensor held by 64 expert-parallel files costs one candidate per TP rank, not 64.
    seen: set[tuple[str, int | None, int]] = set()
    for index, file in enumerate(source.files):
        tp_rank = file.rank[0] if file.rank else None
        for tensor in file.tensors:
            alike = (tensor.canonical, tp_rank, id(tensor.pieces))
            if alike in seen:
                continue
            seen.add(alike)
            holders[tensor.canonical].append((index, tensor))
    ranks = {i: f.rank for i, f in enumerate(source.files)}
    covers: dict[tuple, tuple[list[Found], bool]] = {}

    missing: list[str] = []
    files = []
    bytes_read = requests = peak = 0
    for target in targets:
        writes = []
        for tensor in target.tensors:
            candidates = _holders_of(tensor.canonical, holders)
            state, _, weight = tensor.canonical.partition("/")
            if not candidates and state == "fp32_param" and source.weights_are_masters:
                candidates = _holders_of(weight, holders)
            if (
                not candidates
                and tensor.canonical.startswith("step/")
                and (source.optimizer_step is not None)
            ):
                # The distributed optimizer keeps Adam's step per group, not per parameter.
                writes.append(
                    TensorWrite(
                        key=tensor.key,
                        canonical=tensor.canonical,
                        shape=tensor.shape,
                        dtype=tensor.dtype,
                        copies=(),
                        padding=tensor.numel,
                        fill=source.optimizer_step,
                    )
                )
                continue
            if not candidates:
                missing.append(tensor.canonical)
                continue
            tp = target.rank[0] if target.rank else 0
            prefer = tuple((ranks[i] or (None,))[0] != tp for i, _ in candidates)
            # Layers repeat the same geometry: cover each distinct pattern once. Piece tuples
            # are shared objects (geometry is memoised) and all alive here, so their ids are
            # a cheap, safe key; equal tuples that are distinct objects only cost a recompute.
            held_pieces = tuple(held.pieces for _, held in candidates)
            pattern = (id(tensor.pieces), prefer, tuple(map(id, held_pieces)))
            if pattern not in covers:
                covers[pattern] = _cover(tensor.pieces, prefer, held_pieces)
            found, complete = covers[pattern]
            if not complete:
                missing.append(f"{tensor.canonical} (part)")
            copies = []
            for position, src, dst, sizes in found:
                index, held = candidates[position]
                view = None if held.view_offset is None else (held.view_offset, held.shape)
                copies.append(
                    CopyOp(
                        source=index,
                        key=held.key,
                        src=src,
                        dst=dst,
                        sizes=sizes,
                        view=view,
                        transposed=held.transposed,
                    )
                )
                bytes_read += nbytes(sizes, held.dtype)
            requests += len(found)
            covered = sum(p.numel for p in tensor.pieces)
            writes.append(
                TensorWrite(
                    key=tensor.key,
                    canonical=tensor.canonical,
                    shape=tensor.shape,
                    dtype=tensor.dtype,
                    copies=tuple(copies),
                    padding=tensor.numel - covered,
                    view_offset=tensor.view_offset,
                    transposed=tensor.transposed,
                    base_shape=tensor.base_shape,
                    padded_origin=tensor.padded_origin,
                )
            )
            peak = max(peak, 2 * nbytes(tensor.shape, "float32"))
        files.append(
            FileWrite(
                path=target.path,
                kind=(flat_kind or kind) if target.flat else kind,
                tensors=tuple(writes),
                rank=target.rank,
                ep_rank=target.ep_rank,
                carry_from=carry_from,
                flat=target.flat,
            )
        )
    if missing:
        shown = ", ".join(sorted(set(missing))[:5])
        more = f" and {len(set(missing)) - 5} more" if len(set(missing)) > 5 else ""
        raise CheckpointError(f"the source holds no data for {shown}{more}")
    written = sum(nbytes(t.shape, t.dtype) for f in targets for t in f.tensors)
    return tuple(files), Estimates(
        bytes_read=bytes_read,
        bytes_written=written,
        read_requests=requests,
        peak_memory_bytes=peak,
        write_requests=len(targets),
    )


def plan_target(
    source: CheckpointView, target: TargetPlanner, planned: TargetFiles
) -> tuple[tuple[FileWrite, ...], Estimates]:
    """The writes of a target format's files, and what else of the source it keeps."""
    files, estimates = plan_files(
        source,
        planned.files,
        planned.kind,
        carry_from=0 if planned.carries_rank_state else None,
        flat_kind=planned.flat_kind,
    )
    files, read = target.with_source_state(source, files, planned.layout)
    if read:
        estimates = estimates.model_copy(update={"bytes_read": estimates.bytes_read + read})
    return files, estimates


class SourceFields(TypedDict):
    """The fields every plan records about the checkpoint it reads (``Plan(**fields)``)."""

    source_url: str
    source_format: str
    source_fingerprint: str
    source_files: tuple[str, ...]
    spec: ModelSpec | None
    source_layout: ParallelLayout
    iteration: int | None


def from_source(source: CheckpointView, url: str, fingerprint: str) -> SourceFields:
    """The fields every plan records about the checkpoint it reads."""
    return {
        "source_url": url,
        "source_format": source.format,
        "source_fingerprint": fingerprint,
        "source_files": tuple(f.path for f in source.files),
        "spec": source.spec,
        "source_layout": source.layout,
        "iteration": source.iteration,
    }
