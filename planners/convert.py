"""Plan a conversion: fill every target tensor from the source pieces that overlap it.

Each target piece is covered greedily by source pieces of the same canonical tensor, skipping
any that would cover an element twice (TP-replicated norms and tied-embedding copies are held by
several files; one is enough). Source holders are tried in a deterministic order that prefers
the file with the target's own TP rank, so replicated tensors are read from different files
rather than all from rank 0.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
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
    planner = _Planner(source, _holders(source))
    files = []
    read = written = requests = 0
    by_rank: dict[int, dict[int, _Planned]] = defaultdict(dict)
    for target in targets:
        # Hot: once per tensor of the target (350,000 for a trillion-parameter checkpoint). A
        # tensor object met again in a file of the same TP rank (the dense tensors every EP
        # rank's file shares) is planned once; counts are kept in locals.
        tp = target.rank[0] if target.rank else 0
        planned, plan = by_rank[tp], planner.plan
        tensors = []
        for tensor in target.tensors:
            known = planned.get(id(tensor))
            if known is None:
                known = planned[id(tensor)] = plan(tensor, tp)
            tensors.append(known[0])
            read += known[1]
            written += known[2]
            requests += known[3]
        files.append(
            FileWrite(
                path=target.path,
                kind=(flat_kind or kind) if target.flat else kind,
                tensors=tuple(tensors),
                rank=target.rank,
                ep_rank=target.ep_rank,
                carry_from=carry_from,
                flat=target.flat,
                mesh=target.mesh,
            )
        )
    if planner.missing:
        missing = sorted(set(planner.missing))
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"the source holds no data for {', '.join(missing[:5])}{more}")
    return tuple(files), Estimates(
        bytes_read=read,
        bytes_written=written,
        read_requests=requests,
        peak_memory_bytes=max((2 * nbytes(s, "float32") for s in planner.shapes), default=0),
        write_requests=len(targets),
    )


def _holders(source: CheckpointView) -> dict[str, list[tuple[int, StoredTensor]]]:
    """Which files (indices) hold each canonical tensor, and as what stored tensor.

    Copies of one box in files of the same TP rank (a dense tensor in every EP rank's file)
    are alike to the cover, which takes the first: only the first is kept, so a tensor held by
    64 expert-parallel files costs one candidate per TP rank, not 64."""
    holders: dict[str, list[tuple[int, StoredTensor]]] = {}
    tp_of = [file.rank[0] if file.rank else None for file in source.files]
    for index, file in enumerate(source.files):
        tp_rank = tp_of[index]
        for tensor in file.tensors:
            held = holders.get(tensor.canonical)
            if held is None:  # most tensors of a large checkpoint: its experts' are held once
                holders[tensor.canonical] = [(index, tensor)]
            elif held[0][1] is tensor and tp_of[held[0][0]] == tp_rank:
                continue  # the same object, in another EP rank's file (the common repeat)
            elif not any(
                other.pieces is tensor.pieces and tp_of[i] == tp_rank for i, other in held
            ):
                held.append((index, tensor))
    return holders


_NOT_HELD: list[tuple[int, StoredTensor]] = []
_Planned = tuple[TensorWrite, int, int, int]
"""A target tensor's write, the bytes it reads and writes, and its read requests."""
_Cover = tuple[list[Found], int, bool, int]
"""How target pieces are filled: the boxes copied, the bytes they read, whether they cover
every element, and how many elements the pieces hold."""


class _Planner:
    """The write of each target tensor. A trillion-parameter plan holds hundreds of thousands
    of tensors that repeat a few patterns (every layer alike, every dense tensor in each
    expert-parallel file), so what a write needs is remembered under the identity of the
    shared objects it comes from: the holders per name, the cover per geometry (and, in
    ``plan_files``, the write per target tensor object). The objects keyed by ``id`` are all
    held alive by the source view, the targets or these caches for the whole planning, so an
    id is never reused for another object meanwhile."""

    def __init__(
        self, source: CheckpointView, holders: dict[str, list[tuple[int, StoredTensor]]]
    ) -> None:
        self.source = source
        self.holders = holders
        self.ranks = {i: (f.rank or (None,))[0] for i, f in enumerate(source.files)}
        self.fallbacks: dict[str, list[tuple[int, StoredTensor]]] = {}
        self.covers: dict[tuple, _Cover] = {}
        self.shapes: set[Shape] = set()
        self.missing: list[str] = []

    def fallback(self, canonical: str) -> list[tuple[int, StoredTensor]]:
        """Holders of what stands in for ``canonical`` when no file holds it by name."""
        found = self.fallbacks.get(canonical)
        if found is None:
            found = _holders_of(canonical, self.holders)
            state, _, weight = canonical.partition("/")
            if not found and state == "fp32_param" and self.source.weights_are_masters:
                found = _holders_of(weight, self.holders)
            found = self.fallbacks[canonical] = found or _NOT_HELD
        return found

    def plan(self, tensor: StoredTensor, tp: int) -> _Planned:
        """The write of ``tensor`` of a TP rank ``tp`` file, the bytes it reads and writes,
        and its read requests."""
        written = nbytes(tensor.shape, tensor.dtype)
        candidates = self.holders.get(tensor.canonical) or self.fallback(tensor.canonical)
        if candidates is _NOT_HELD:
            return self.unheld(tensor), 0, written, 0
        copies, read, complete, covered = self._copies(candidates, tp, tensor.pieces)
        if not complete:
            self.missing.append(f"{tensor.canonical} (part)")
        self.shapes.add(tensor.shape)
        # Positional (the fields' order), which builds it in a third of the time keywords take.
        done = TensorWrite(
            tensor.key,
            tensor.canonical,
            tensor.shape,
            tensor.dtype,
            copies,
            tensor.numel - covered,  # padding
            0.0,  # fill
            tensor.view_offset,
            tensor.transposed,
            tensor.base_shape,
            tensor.padded_origin,
            tensor.interleaved,
            tensor.shift,
            tensor.shift_rounds,
        )
        return done, read, written, len(copies)

    def unheld(self, tensor: StoredTensor) -> TensorWrite:
        """The write of a tensor no source file holds: Adam's step, which the distributed
        optimizer keeps per group, not per parameter; anything else is missing."""
        if tensor.canonical.startswith("step/") and self.source.optimizer_step is not None:
            return TensorWrite(
                key=tensor.key,
                canonical=tensor.canonical,
                shape=tensor.shape,
                dtype=tensor.dtype,
                copies=(),
                padding=tensor.numel,
                fill=self.source.optimizer_step,
            )
        self.missing.append(tensor.canonical)
        return TensorWrite(
            key=tensor.key, canonical=tensor.canonical, shape=tensor.shape, dtype=tensor.dtype,
            copies=(),
        )  # fmt: skip

    def _copies(
        self, candidates: list[tuple[int, StoredTensor]], tp: int, pieces: tuple[Piece, ...]
    ) -> tuple[tuple[CopyOp, ...], int, bool, int]:
        """The copies filling ``pieces`` (of a TP rank ``tp`` file) from ``candidates``, the
        bytes they read, whether they fill every element, and how many they fill."""
        # Layers repeat the same geometry: each distinct pattern is covered once (piece tuples
        # are memoised, shared objects).
        pattern: tuple
        if len(candidates) == 1:  # the common case, every expert: one holder, no preference
            held = candidates[0][1]
            prefer: tuple[bool, ...] = (False,)
            pattern = (id(pieces), id(held.pieces), held.dtype)
        else:
            prefer = tuple(self.ranks[i] != tp for i, _ in candidates)
            pattern = (id(pieces), prefer, *((id(h.pieces), h.dtype) for _, h in candidates))
        cover = self.covers.get(pattern)
        if cover is None:
            held_pieces = tuple(held.pieces for _, held in candidates)
            dtypes = tuple(held.dtype for _, held in candidates)
            cover = self.covers[pattern] = _cover_of(pieces, prefer, held_pieces, dtypes)
        boxes, read, complete, covered = cover
        copies = tuple([_copy(candidates[at], src, dst, sizes) for at, src, dst, sizes in boxes])
        return copies, read, complete, covered


def _copy(candidate: tuple[int, StoredTensor], src: Shape, dst: Shape, sizes: Shape) -> CopyOp:
    index, held = candidate
    view = None if held.view_offset is None else (held.view_offset, held.shape)
    return CopyOp(index, held.key, src, dst, sizes, view, held.transposed)  # fields' order


def _cover_of(
    pieces: tuple[Piece, ...],
    prefer: tuple[bool, ...],
    held_pieces: tuple[tuple[Piece, ...], ...],
    dtypes: tuple[str, ...],
) -> _Cover:
    """``_cover`` with the bytes its copies read (holders' ``dtypes``) and the elements of
    ``pieces``."""
    found, complete = _cover(pieces, prefer, held_pieces)
    read = sum(nbytes(sizes, dtypes[position]) for position, _, _, sizes in found)
    return found, read, complete, sum(p.numel for p in pieces)


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


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector paused while a plan is built: a large plan creates hundreds
    of thousands of small acyclic objects (tensors, writes, copies), and each of the
    collections they trigger walks every object alive, the plan so far included, which made
    the collector ~40% of the planning time of a trillion-parameter checkpoint. What planning
    makes is acyclic; any cycle it leaves is collected once the collector runs again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class SourceFields(TypedDict):
    """The fields every plan records about the checkpoint it reads (``Plan(**fields)``)."""

    source_url: str
    source_format: str
    source_fingerprint: str
    source_files: tuple[str, ...]
    spec: ModelSpec | None
    source_layout: ParallelLayout
    source_mesh: tuple[int, ...]
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
        "source_mesh": next((f.mesh for f in source.files if f.mesh), ()),
        "iteration": source.iteration,
    }
