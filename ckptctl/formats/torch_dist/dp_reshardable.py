"""Megatron's ``dp_reshardable`` distributed-optimizer state in a ``torch_dist`` checkpoint,
placed on the canonical tensors. Pure.

With ``--use-distributed-optimizer`` and no ``--dist-ckpt-optim-fully-reshardable`` (Megatron's
default), the optimizer state is saved as the grad buffers themselves: per model-parallel rank
``g`` (``pp_rank * TP + tp_rank``), grad buffer ``i`` (a model chunk's, per dtype pair) and bucket
``b``, one flat fp32 tensor per state (under a chained optimizer, EP > 1, each key starts with
``chained_<i>.``: 0 for the dense parameters, 1 for the experts', whose ``g`` counts ranks of
the expert tensor-model-pipeline group) (``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>
.dtype_(<param>, <grad>).bucket_idx_<b>.<state>``) of the bucket's unpadded size, with no
names. Where each parameter lies in it is the grad-buffer layout Megatron builds, which ckptctl
replays for ``distrib_optim.pt`` (``distopt_layout``): the same buffers, concatenated there with
their end padding stripped, so a parameter's offset in the concatenation, less the sizes of the
buckets before its own, is its offset in its bucket. The file's DCP chunks cut the bucket at
parameter and data-parallel boundaries; each part of a parameter a chunk holds is described as
the row boxes that part covers.
"""

from __future__ import annotations

import re
from math import prod

from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_container.metadata import TensorEntry
from ckptctl.formats.megatron_common.layout import ExpertNaming
from ckptctl.formats.torch_dist.bucket_replay import replay
from ckptctl.model.catalog import Naming
from ckptctl.model.geometry import Shape, chunk_pieces, padding_origin
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import OptimizerLayout
from ckptctl.model.stored import StoredTensor

KEY = re.compile(
    r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)"
    r"\.dtype_\((.*)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$"
)

Where = tuple[int, int, int, str, str]
"""``(sub-optimizer, model-parallel rank, grad buffer, dtype key, state)``: one bucket list."""


def parse(fqn: str) -> tuple[Where, int] | None:
    """Which bucket list a bucket tensor belongs to and its bucket number; the dtype key as
    ``distrib_optim.pt`` spells it (``bfloat16|float32``), the sub-optimizer 0 unless chained
    (dense then expert parameters, ``chained_<i>.``)."""
    found = KEY.match(fqn)
    if found is None:
        return None
    sub, group, gbuf, dtypes, bucket, state = found.groups()
    names = [d.strip().removeprefix("torch.") for d in dtypes.split(",")]
    return (int(sub or 0), int(group), int(gbuf), "|".join(names), state), int(bucket)


def place(
    entries: dict[str, TensorEntry],
    spec: ModelSpec,
    layout: ParallelLayout,
    optimizer: OptimizerLayout,
    weight_dtype: str,
    naming: Naming,
    expert_naming: ExpertNaming = ExpertNaming.SEQUENTIAL,
) -> list[StoredTensor]:
    """Every parameter's part of every bucket tensor in ``entries`` (the checkpoint's bucket
    tensors by key), as stored tensors keyed ``(fqn, chunk offset)``; ``CheckpointError`` when
    the replayed layout does not match the buckets stored (sizes, or a parameter across two)."""
    buckets: dict[Where, dict[int, tuple[str, TensorEntry]]] = {}
    for fqn, entry in entries.items():
        parsed = parse(fqn)
        if parsed is None:
            raise CheckpointError(
                f"{fqn}: not a bucket of the distributed optimizer's grad buffers"
            )
        where, bucket = parsed
        buckets.setdefault(where, {})[bucket] = (fqn, entry)
    placed: list[StoredTensor] = []
    seen: set[Where] = set()
    for replayed in replay(spec, layout, optimizer, weight_dtype, naming, expert_naming):
        sub, group = replayed.sub, replayed.group
        for tensor in replayed.tensors:
            where = (sub, group, int(tensor.key[-3]), str(tensor.key[-2]), str(tensor.key[-1]))
            stored = buckets.get(where)
            if stored is None:
                raise CheckpointError(
                    f"no dp_reshardable bucket tensors for optimizer {sub}'s model-parallel rank "
                    f"{group}, grad buffer {where[2]} ({where[3]}), state {where[4]}"
                )
            seen.add(where)
            placed += _parts(tensor, stored)
    if missing := set(buckets) - seen:
        sub, group, gbuf, dtype_key, state = sorted(missing)[0]
        raise CheckpointError(
            f"dp_reshardable buckets of optimizer {sub}'s model-parallel rank {group}, grad "
            f"buffer {gbuf} ({dtype_key}, {state}) belong to no parameter of the model its args "
            "describe"
        )
    return placed


def _parts(tensor: StoredTensor, stored: dict[int, tuple[str, TensorEntry]]) -> list[StoredTensor]:
    """``tensor`` (a parameter's slice of the stripped concatenation, from ``view_offset``) as
    the parts of its bucket tensor's chunks that hold it."""
    at, numel = tensor.view_offset or 0, prod(tensor.shape)
    base = 0
    for bucket in range(len(stored)):
        if bucket not in stored:
            raise CheckpointError(f"bucket {bucket} of {next(iter(stored.values()))[0]} missing")
        fqn, entry = stored[bucket]
        size = entry.shape[0]
        if base <= at < base + size:
            start = at - base
            if start + numel > size:
                raise CheckpointError(
                    f"{fqn}: {tensor.canonical} would run past the bucket's {size} elements; "
                    "the replayed grad-buffer layout does not match the one saved"
                )
            return [
                part
                for chunk in entry.chunks
                for part in _chunk_parts(tensor, fqn, chunk.offsets[0], chunk.sizes[0], start)
            ]
        base += size
    raise CheckpointError(
        f"{tensor.canonical}: its replayed offset {at} lies past the {base} elements the "
        "dp_reshardable buckets hold; the grad-buffer layout does not match the one saved"
    )


def _chunk_parts(
    tensor: StoredTensor, fqn: str, chunk_start: int, chunk_size: int, start: int
) -> list[StoredTensor]:
    """The part of ``tensor`` (at ``start`` in the bucket) that the chunk at ``chunk_start``
    holds, as boxes of the parameter read from the chunk's record."""
    lo = max(start, chunk_start)
    hi = min(start + prod(tensor.shape), chunk_start + chunk_size)
    out = []
    for offsets, sizes, flat in flat_boxes(tensor.shape, lo - start, hi - start):
        pieces = chunk_pieces(tensor.pieces, offsets, sizes)
        out.append(
            StoredTensor(
                (fqn, chunk_start),
                tensor.canonical,
                sizes,
                "float32",
                pieces,
                view_offset=start + flat - chunk_start,
                padded_origin=padding_origin(tensor.pieces, offsets, sizes, pieces),
            )
        )
    return out


def flat_boxes(shape: Shape, lo: int, hi: int) -> list[tuple[Shape, Shape, int]]:
    """Elements ``[lo, hi)`` of a C-ordered tensor of ``shape`` as boxes ``(offsets, sizes,
    first flat element)``, each contiguous in memory: a partial row, whole rows, a partial row
    (recursively for more dimensions)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)] if shape else [((), (), lo)]
    inner = prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [
            ((first, *o), (1, *s), first * inner + f)
            for o, s, f in flat_boxes(shape[1:], lo - first * inner, hi - first * inner)
        ]
    out = []
    whole_from, whole_to = -(-lo // inner), hi // inner
    if lo % inner:
        out += flat_boxes(shape, lo, whole_from * inner)
    if whole_to > whole_from:
        zero = (0,) * (len(shape) - 1)
        out.append(((whole_from, *zero), (whole_to - whole_from, *shape[1:]), whole_from * inner))
    if hi % inner:
        out += flat_boxes(shape, whole_to * inner, hi)
    return out
