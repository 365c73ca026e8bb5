"""What a Megatron checkpoint keeps beyond the canonical tensors, carried to a Megatron target
(legacy or ``torch_dist``) where it still means the same: the vocabulary padding rows, and each
legacy rank's RNG state. Pure.

Megatron pads the embedding and the output layer to a multiple of ``make_vocab_size_divisible_by
x TP`` rows, and those rows are trained state, not zeros: the padded logits take part in its
softmax, so the output layer's padding rows move the loss, and Adam keeps state for them.
ckptctl's canonical tensors hold the tokenizer's rows only (what HF and DCP targets keep), so a
plan fills a target's padding rows with zeros (``TensorWrite.padding``) unless this pass finds
them in the source: wherever the source and the target pad to the same number of rows, each
padding row is copied from the source rank file that holds it, and Megatron resumes from the
target with the loss it would have had from the source. Where the padded sizes differ (a TP
that changes the padding), the rows are new and stay zero (the plan's note says so).

Rows are found wherever a stored tensor holds a box of a vocabulary tensor whose place is known:
the weights, per-parameter Adam state, a legacy ``distrib_optim.pt``'s slices of its flat
buffers, and the boxes flat buffers cut over data-parallel ranks (``dp_reshardable`` buckets,
``fully_sharded_model_space`` ranges: whole rows or parts of one), which readers place with
``StoredTensor.padded_origin`` where their pieces cannot say. Each target box takes the part of
each holder it overlaps, each element once.

A rank's RNG state (Python's, numpy's, torch's, and the TP-rank-specific streams of the CUDA
RNG tracker) belongs to its place in the TP/PP/EP grid: it is carried to the same rank of an
unchanged grid, and dropped where the grid changes (Megatron-LM itself ignores it when it
reshards; a legacy checkpoint without it is resumed with ``--no-load-rng``).
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

from ckptctl.formats.megatron_common.distopt_layout import is_bucket_key
from ckptctl.model.catalog import parameters
from ckptctl.model.geometry import Shape, Split, nbytes
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.plan import CopyOp, FileWrite, TensorWrite
from ckptctl.model.stored import CheckpointView, Format, StoredTensor


def carry_source_state(
    source: CheckpointView, files: tuple[FileWrite, ...], target: ParallelLayout, *, dcp: bool
) -> tuple[tuple[FileWrite, ...], int]:
    """The files of a Megatron target (legacy, or ``torch_dist`` when ``dcp``) with what a
    Megatron source keeps beyond the canonical tensors: vocabulary padding rows, and a legacy
    rank's RNG state on an unchanged grid; the bytes that reads."""
    if source.format not in (Format.MEGATRON, Format.TORCH_DIST) or source.spec is None:
        return files, 0
    files, read = carry_vocab_padding(source, files, source.spec, target, dcp=dcp)
    if not dcp and source.format == Format.MEGATRON and same_rank_grid(source.layout, target):
        files = carry_rank_rng(source, files)
    return files, read


def carry_vocab_padding(
    source: CheckpointView,
    files: tuple[FileWrite, ...],
    spec: ModelSpec,
    target: ParallelLayout,
    *,
    dcp: bool,
) -> tuple[tuple[FileWrite, ...], int]:
    """``files`` with the padding rows of their vocabulary tensors copied from ``source``
    where both pad to the same size (``dcp``: they are ``torch_dist`` files); and the bytes
    those copies read."""
    padded = spec.padded_vocab_size(target.tp)
    if spec.padded_vocab_size(source.layout.tp) != padded or padded == spec.vocab_size:
        return files, 0
    vocab = {p.name for p in parameters(spec) if p.split is Split.VOCAB}
    holders = padding_holders(source)
    read = 0
    out = []
    for write in files:
        tensors = []
        for tensor in write.tensors:
            found = _padding_holders(tensor, holders) if tensor.padding else None
            if found and _is_vocab_box(tensor.canonical, tensor.shape, vocab):
                origin = _origin(tensor, write.rank, dcp)
                if origin is not None and not tensor.transposed:
                    tensor, moved = _with_padding_rows(tensor, origin, spec.vocab_size, found)
                    read += moved
            tensors.append(tensor)
        out.append(write.model_copy(update={"tensors": tuple(tensors)}) if tensors else write)
    return tuple(out), read


PaddingHolder = tuple[int, Shape, StoredTensor]
"""``(source file index, where its box lies in the padded tensor, stored tensor)``."""


def padding_holders(source: CheckpointView) -> dict[str, list[PaddingHolder]]:
    """Per vocabulary tensor (weights and optimizer state), the stored boxes of it whose place
    in the padded tensor is known, with that place; empty where the source has no padding
    rows."""
    spec = source.spec
    if spec is None:
        return {}
    if spec.padded_vocab_size(source.layout.tp) == spec.vocab_size:
        return {}
    vocab = {p.name for p in parameters(spec) if p.split is Split.VOCAB}
    holders: dict[str, list[PaddingHolder]] = {}
    for index, file in enumerate(source.files):
        for held in file.tensors:
            if not _is_vocab_box(held.canonical, held.shape, vocab):
                continue
            origin = _origin(held, file.rank, source.format == Format.TORCH_DIST)
            if origin is not None and not held.transposed:
                holders.setdefault(held.canonical, []).append((index, origin, held))
    return holders


def _padding_holders(
    tensor: TensorWrite, holders: dict[str, list[PaddingHolder]]
) -> list[PaddingHolder]:
    """Who holds ``tensor``'s rows; an fp32 master is the fp32 weight itself where the source
    keeps no separate masters (Megatron's fp32 runs without the distributed optimizer)."""
    found = holders.get(tensor.canonical, [])
    state, _, weight = tensor.canonical.partition("/")
    if not found and state == "fp32_param":
        found = [h for h in holders.get(weight, []) if h[2].dtype == "float32"]
    return found


def _origin(
    tensor: StoredTensor | TensorWrite, rank: tuple[int, int] | None, dcp: bool
) -> Shape | None:
    """Where a box of a vocabulary tensor lies in the padded tensor: its ``padded_origin``,
    where its pieces put it, or, for one of padding rows alone, a DCP chunk's offsets
    (``torch_dist``: key ``(fqn, row, column)``; a flat bucket's offset says nothing) or its TP
    rank's share (a legacy rank file, whose tensors hold one whole)."""
    if tensor.padded_origin is not None:
        return tensor.padded_origin
    pieces = getattr(tensor, "pieces", None)
    if pieces:
        first = pieces[0]
        return tuple(c - local for c, local in zip(first.canonical, first.local, strict=True))
    key, rows, columns = tensor.key, tensor.shape[0], tensor.shape[1]
    if dcp and is_bucket_key(str(key[0])):
        return None
    if dcp and len(key) == 4:
        # fully_sharded_model_space, ``(fqn, row box, column box, start)``: a box ckptctl
        # writes is whole (``base_shape`` says so); a read one may be any part of its box.
        whole = getattr(tensor, "base_shape", None) is not None
        return (int(key[1]) * rows, int(key[2]) * columns) if whole else None
    if dcp:
        return (int(key[1]), int(key[2])) if len(key) == 3 else None
    return (rank[0] * rows, 0) if rank is not None else None


def _is_vocab_box(canonical: str, shape: Shape, vocab: set[str]) -> bool:
    """Whether a tensor is a box of a vocabulary tensor (the weight or its Adam state, not the
    scalar step Adam keeps beside them)."""
    return canonical.rpartition("/")[2] in vocab and len(shape) == 2


def _with_padding_rows(
    tensor: TensorWrite, origin: Shape, vocab: int, holders: list[PaddingHolder]
) -> tuple[TensorWrite, int]:
    """``tensor`` (the box at ``origin`` of a padded vocabulary tensor) with copies of its
    padding rows from the ``holders``: each holder's overlap with the box's rows past the
    vocabulary, each element once (replicas of a part already taken, as other DP ranks' or
    EP ranks' copies, are skipped)."""
    (top, left), (rows, columns) = origin, tensor.shape
    lo, hi = max(vocab, top), top + rows
    copies = list(tensor.copies)
    taken: list[tuple[int, int, int, int]] = []
    elements = moved = 0
    for index, (h_top, h_left), held in sorted(holders, key=lambda h: h[1]):
        r0, r1 = max(lo, h_top), min(hi, h_top + held.shape[0])
        c0, c1 = max(left, h_left), min(left + columns, h_left + held.shape[1])
        if r0 >= r1 or c0 >= c1:
            continue
        if any(a < r1 and r0 < b and c < c1 and c0 < d for a, b, c, d in taken):
            continue
        taken.append((r0, r1, c0, c1))
        sizes = (r1 - r0, c1 - c0)
        view = None if held.view_offset is None else (held.view_offset, held.shape)
        copies.append(
            CopyOp(
                source=index,
                key=held.key,
                src=(r0 - h_top, c0 - h_left),
                dst=(r0 - top, c0 - left),
                sizes=sizes,
                view=view,
            )
        )
        elements += prod(sizes)
        moved += nbytes(sizes, held.dtype)
    if not elements:
        return tensor, 0
    return replace(tensor, copies=tuple(copies), padding=tensor.padding - elements), moved


def same_rank_grid(source: ParallelLayout, target: ParallelLayout) -> bool:
    """Whether every rank file of ``target`` has the place in the TP/PP/EP grid that the
    source rank file of the same coordinates had (then its RNG state still fits)."""
    return (source.tp, source.pp, source.ep, source.expert_tp) == (
        target.tp,
        target.pp,
        target.ep,
        target.expert_tp,
    )


def carry_rank_rng(source: CheckpointView, files: tuple[FileWrite, ...]) -> tuple[FileWrite, ...]:
    """``files`` carrying their training state (RNG included) from the source rank file of the
    same (TP, PP, EP) coordinates; for an unchanged grid only (``same_rank_grid``)."""
    by_rank: dict[tuple[tuple[int, int] | None, int], int] = {
        (file.rank, file.ep_rank): index
        for index, file in enumerate(source.files)
        if file.rank is not None and not file.flat
    }
    out = []
    for file in files:
        index = by_rank.get((file.rank, file.ep_rank))
        if file.rank is None or file.flat or index is None:
            out.append(file)
        else:
            out.append(file.model_copy(update={"carry_from": index, "carry_rng": True}))
    return tuple(out)
