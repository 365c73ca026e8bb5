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

from ckptctl.errors import CheckpointError, UsageError
from ckptctl.model.geometry import Piece, Shape, box_difference, nbytes, overlap
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.plan import CopyOp, Estimates, FileKind, FileWrite, TensorWrite
from ckptctl.model.stored import CheckpointView, Format, StoredFile, StoredTensor
from planners.megatron_rank_state import carry_rank_rng, carry_vocab_padding, same_rank_grid

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
    kind: FileKind,
    *,
    carry_from: int | None = None,
) -> tuple[tuple[FileWrite, ...], Estimates]:
    """Copy operations for every tensor of ``targets`` out of ``source``'s files."""
    holders: dict[str, list[tuple[int, StoredTensor]]] = defaultdict(list)
    for index, file in enumerate(source.files):
        for tensor in file.tensors:
            holders[tensor.canonical].append((index, tensor))
    ranks = {i: f.rank for i, f in enumerate(source.files)}
    distopt = FileKind.DISTRIBUTED_OPTIMIZER
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
                kind=distopt if target.flat else kind,
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


def megatron_target_notes(
    source: CheckpointView, target_layout: ParallelLayout, target_format: Format
) -> tuple[list[str], list[str]]:
    """What a Megatron-family target cannot keep as it was, said the same way by every
    operation that writes one (reshard, consolidate --format megatron): notes, warnings."""
    notes, warnings = [], []
    spec = source.spec
    assert spec is not None
    old, new = spec.padded_vocab_size(source.layout.tp), spec.padded_vocab_size(target_layout.tp)
    if source.format in (Format.MEGATRON, Format.TORCH_DIST) and old != new:
        notes.append(
            f"vocabulary padding recomputed for tp={target_layout.tp}: {old} -> {new} rows; "
            "padding rows of embedding, output layer and their optimizer state are zeros"
        )
    same_grid = same_rank_grid(source.layout, target_layout)
    if source.format == Format.MEGATRON and target_format == Format.MEGATRON and not same_grid:
        warnings.append(
            "RNG state belongs to each rank's place in the TP/PP/EP grid, which changes: "
            "dropped, as Megatron-LM does when it reshards; resume with --no-load-rng"
        )
    return notes, warnings


def megatron_rank_files(
    source: CheckpointView, files: tuple[FileWrite, ...], target: ParallelLayout
) -> tuple[tuple[FileWrite, ...], int]:
    """The files of a Megatron target (legacy or ``torch_dist``) with what a Megatron source
    keeps beyond the canonical tensors (``planners.megatron_rank_state``); the bytes that
    reads."""
    if source.format not in (Format.MEGATRON, Format.TORCH_DIST) or source.spec is None:
        return files, 0
    files, read = carry_vocab_padding(source, files, source.spec, target)
    legacy = all(f.kind != FileKind.DCP_SHARD for f in files)
    if legacy and source.format == Format.MEGATRON and same_rank_grid(source.layout, target):
        files = carry_rank_rng(source, files)
    return files, read


def refuse_frozen(source: CheckpointView, carries_optimizer: bool, target: str) -> None:
    """Frozen parameters (DeepSpeed) have no Adam state, and Megatron's optimizers hold every
    parameter: refuse rather than invent state for them."""
    if source.frozen and carries_optimizer:
        raise UsageError(
            f"frozen parameters ({', '.join(source.frozen[:3])}) have no Adam state, but "
            f"{target}'s optimizer holds every parameter: consolidate --format torch or "
            "deepspeed-universal keeps the trained parameters' state, --format hf the weights"
        )


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
