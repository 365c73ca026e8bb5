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

Rows are found wherever a stored tensor holds a TP rank's whole share of a vocabulary tensor: the
weights, per-parameter Adam state, and a legacy ``distrib_optim.pt``'s slices of its flat buffers
(fp32 masters and moments). ``dp_reshardable`` buckets cut over data-parallel ranks hold rows
whose place in the vocabulary the chunk does not say; a target written as those buckets (none
is yet) would start its padding from zeros.

A rank's RNG state (Python's, numpy's, torch's, and the TP-rank-specific streams of the CUDA
RNG tracker) belongs to its place in the TP/PP/EP grid: it is carried to the same rank of an
unchanged grid, and dropped where the grid changes (Megatron-LM itself ignores it when it
reshards; a legacy checkpoint without it is resumed with ``--no-load-rng``).
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

from ckptctl.formats.torch_dist.layout import is_bucket_key
from ckptctl.model.catalog import parameters
from ckptctl.model.geometry import Shape, Split, nbytes
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.plan import CopyOp, FileKind, FileWrite, TensorWrite
from ckptctl.model.stored import CheckpointView, Format, StoredTensor


def carry_vocab_padding(
    source: CheckpointView, files: tuple[FileWrite, ...], spec: ModelSpec, target: ParallelLayout
) -> tuple[tuple[FileWrite, ...], int]:
    """``files`` with the padding rows of their vocabulary tensors copied from ``source``
    where both pad to the same size; and the bytes those copies read."""
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
            if found and _rows_of_vocab(tensor.canonical, tensor.shape, vocab, padded, target.tp):
                dcp = write.kind == FileKind.DCP_SHARD
                first = _first_row(tensor, write.rank, dcp)
                if first is not None and not tensor.transposed:
                    tensor, moved = _with_padding_rows(tensor, first, spec.vocab_size, found)
                    read += moved
            tensors.append(tensor)
        out.append(write.model_copy(update={"tensors": tuple(tensors)}) if tensors else write)
    return tuple(out), read


PaddingHolder = tuple[int, int, StoredTensor]
"""``(source file index, first row of the padded vocabulary it holds, stored tensor)``."""


def padding_holders(source: CheckpointView) -> dict[str, list[PaddingHolder]]:
    """Per vocabulary tensor (weights and optimizer state), the stored tensors that hold a TP
    rank's whole share of its padded rows, with the first row each holds; empty where the
    source has no padding rows."""
    spec = source.spec
    if spec is None:
        return {}
    padded = spec.padded_vocab_size(source.layout.tp)
    if padded == spec.vocab_size:
        return {}
    vocab = {p.name for p in parameters(spec) if p.split is Split.VOCAB}
    holders: dict[str, list[PaddingHolder]] = {}
    for index, file in enumerate(source.files):
        for held in file.tensors:
            if not _rows_of_vocab(held.canonical, held.shape, vocab, padded, source.layout.tp):
                continue
            first = _first_row(held, file.rank, source.format == Format.TORCH_DIST)
            if first is not None and not held.transposed:
                holders.setdefault(held.canonical, []).append((index, first, held))
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


def _first_row(
    tensor: StoredTensor | TensorWrite, rank: tuple[int, int] | None, dcp: bool
) -> int | None:
    """A vocabulary tensor's first row in the padded vocabulary: where its pieces put it, or,
    for one of padding rows alone, a DCP chunk's row offset (``torch_dist``: key ``(fqn, row,
    column)``; a distributed-optimizer bucket's flat offset says nothing) or its TP rank's share
    (a legacy rank file)."""
    pieces = getattr(tensor, "pieces", None)
    if pieces:
        return pieces[0].canonical[0] - pieces[0].local[0]
    key = tensor.key
    if dcp and not is_bucket_key(str(key[0])):
        if len(key) == len(tensor.shape) + 2:
            # fully_sharded_model_space: ``(fqn, row box, column box, start)``; a box ckptctl
            # writes is whole (``base_shape`` says so), one read may be any part of its box.
            whole = getattr(tensor, "base_shape", None) is not None
            return int(key[1]) * tensor.shape[0] if whole else None
        return key[1] if len(key) > 1 and isinstance(key[1], int) else None
    # a legacy rank file's tensor, or a bucket chunk ckptctl writes (one TP shard whole)
    return rank[0] * tensor.shape[0] if rank is not None else None


def _rows_of_vocab(canonical: str, shape: Shape, vocab: set[str], padded: int, tp: int) -> bool:
    """Whether a tensor is one TP rank's rows of a padded vocabulary tensor (the weight or its
    Adam state, not the scalar step Adam keeps beside them)."""
    return canonical.rpartition("/")[2] in vocab and bool(shape) and shape[0] * tp == padded


def _with_padding_rows(
    tensor: TensorWrite, first: int, vocab: int, holders: list[tuple[int, int, StoredTensor]]
) -> tuple[TensorWrite, int]:
    """``tensor`` (rows ``first`` on of a padded vocabulary tensor) with copies of its padding
    rows from the ``holders`` (source index, first padded row, stored tensor)."""
    rows, rest = tensor.shape[0], tensor.shape[1:]
    lo, hi = max(vocab, first), first + rows  # the padding rows this rank holds
    copies = list(tensor.copies)
    elements = moved = 0
    for index, start, held in sorted(holders, key=lambda h: h[1]):
        a, b = max(lo, start), min(hi, start + held.shape[0])
        if a >= b or held.shape[1:] != rest:
            continue
        zero = (0,) * len(rest)
        sizes = (b - a, *rest)
        src, dst = (a - start, *zero), (a - first, *zero)
        view = None if held.view_offset is None else (held.view_offset, held.shape)
        copies.append(CopyOp(source=index, key=held.key, src=src, dst=dst, sizes=sizes, view=view))
        elements += prod(sizes)
        moved += nbytes(sizes, held.dtype)
        lo = b  # each row once: replicas of rows already taken (other DP ranks) are skipped
        if lo >= hi:
            break
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
