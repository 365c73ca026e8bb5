"""Writing the distributed optimizer's state as Megatron's ``dp_reshardable`` grad-buffer
buckets (``--optim-sharding dp_reshardable``): which bucket chunks each ``.distcp`` file holds,
and the objects Megatron keeps beside them. Pure.

The buckets are the grad-buffer layout of the *target* (``distopt_layout``, replayed as for
``distrib_optim.pt``): per sub-optimizer, model-parallel rank, grad buffer and bucket, one flat
fp32 tensor per state of the bucket's unpadded size. Each parameter's range in it is written as
one chunk (its TP shard, whole rows), in the file of the model-parallel rank that owns it;
Megatron's loader reads any chunking. Beside the buckets Megatron keeps, per model-parallel
rank, the torch optimizer's parameter groups and the padded and unpadded bucket sizes, which
its loader checks against its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import lcm, prod

from ckptctl.errors import LayoutError
from ckptctl.formats.megatron_common.layout import ExpertNaming
from ckptctl.formats.torch_dist.bucket_replay import replay
from ckptctl.formats.torch_dist.dp_reshardable import flat_boxes, parse
from ckptctl.model.catalog import Naming
from ckptctl.model.geometry import chunk_pieces, padding_origin
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import OptimizerLayout
from ckptctl.model.stored import StoredFile, StoredTensor


def bucket_fqn(
    chained: bool, sub: int, group: int, gbuf: int, dtype_key: str, bucket: int, state: str
) -> str:
    """The key Megatron saves a bucket under (``parse`` reads it back)."""
    dtypes = ", ".join(f"torch.{name}" for name in dtype_key.split("|"))
    prefix = f"chained_{sub}." if chained else ""
    return (
        f"{prefix}optimizer.distributed.dp_group_idx_{group}.gbuf_idx_{gbuf}.dtype_({dtypes})"
        f".bucket_idx_{bucket}.{state}"
    )


def with_buckets(
    files: tuple[StoredFile, ...],
    spec: ModelSpec,
    layout: ParallelLayout,
    optimizer: OptimizerLayout,
    weight_dtype: str,
    naming: Naming,
    expert_naming: ExpertNaming,
) -> tuple[StoredFile, ...]:
    """``files`` (a ``torch_dist`` target without per-parameter optimizer state) with the
    bucket chunks of each model-parallel rank added to that rank's file; each chunk's
    ``base_shape`` is its bucket's (the global shape of the tensor it is a chunk of)."""
    chained = replace(optimizer, chained=layout.ep > 1)
    added: dict[tuple[tuple[int, int] | None, int], list[StoredTensor]] = {}
    # per bucket tensor: its owner, size, a state name of it, and the ranges parameters take
    spans: dict[str, tuple[tuple[tuple[int, int] | None, int], int, str, list[tuple[int, int]]]]
    spans = {}
    for group in replay(spec, layout, chained, weight_dtype, naming, expert_naming):
        for tensor in group.tensors:
            gbuf, dtype_key, state = int(tensor.key[-3]), str(tensor.key[-2]), str(tensor.key[-1])
            bucket, start, size = _bucket_at(group.buckets[tensor.key], tensor.view_offset or 0)
            fqn = bucket_fqn(layout.ep > 1, group.sub, group.group, gbuf, dtype_key, bucket, state)
            taken = spans.setdefault(fqn, (group.owner, size, tensor.canonical, []))[3]
            taken.append((start, start + prod(tensor.shape)))
            for offsets, box, flat in flat_boxes(tensor.shape, 0, prod(tensor.shape)):
                pieces = chunk_pieces(tensor.pieces, offsets, box)
                added.setdefault(group.owner, []).append(
                    StoredTensor(
                        (fqn, start + flat),
                        tensor.canonical,
                        box,
                        "float32",
                        pieces,
                        base_shape=(size,),
                        padded_origin=padding_origin(tensor.pieces, offsets, box, pieces),
                    )
                )
    for fqn, (owner, size, canonical, taken) in spans.items():
        added[owner] += _gaps(fqn, size, canonical, taken)
    out = []
    for file in files:
        extra = added.pop((file.rank, file.ep_rank), [])
        out.append(replace(file, tensors=(*file.tensors, *extra)) if extra else file)
    if added:  # every legacy rank has a torch_dist file of the same coordinates
        raise LayoutError(f"no torch_dist file for the buckets of ranks {sorted(added)}")
    return tuple(out)


def _gaps(fqn: str, size: int, canonical: str, taken: list[tuple[int, int]]) -> list[StoredTensor]:
    """The elements of a bucket no parameter takes (each parameter starts aligned to 64
    elements, so a small one leaves a gap before the next), as zero-filled chunks: the
    chunks of a DCP tensor tile it, as Megatron's own save of the whole bucket does. Each
    stands under a state of the bucket (``canonical``) with no pieces: nothing is read."""
    out, at = [], 0
    for start, end in sorted(taken):
        if start > at:
            out.append(
                StoredTensor((fqn, at), canonical, (start - at,), "float32", (), base_shape=(size,))
            )
        at = max(at, end)
    if at < size:
        out.append(
            StoredTensor((fqn, at), canonical, (size - at,), "float32", (), base_shape=(size,))
        )
    return out


def _bucket_at(sizes: tuple[int, ...], at: int) -> tuple[int, int, int]:
    """``(bucket, offset in it, its size)`` of element ``at`` of the buckets' concatenation."""
    base = 0
    for bucket, size in enumerate(sizes):
        if at < base + size:
            return bucket, at - base, size
        base += size
    raise LayoutError(f"offset {at} lies past the {base} elements of the grad buffer")


@dataclass(frozen=True, slots=True)
class BucketGroup:
    """What Megatron keeps beside one model-parallel rank's buckets of one sub-optimizer."""

    prefix: str
    """``optimizer.distributed.dp_group_idx_<g>.``, after ``chained_<i>.`` when chained."""
    sub: int
    unpadded: tuple[tuple[str, tuple[int, ...]], ...]
    """Per grad buffer (in order): its dtype key and its buckets' unpadded sizes."""
    padded: tuple[tuple[str, tuple[int, ...]], ...]
    """The same, each bucket padded to a multiple of ``lcm(dp, 128)``."""


def bucket_groups(
    fqns_and_sizes: list[tuple[str, int]], layout: ParallelLayout
) -> list[BucketGroup]:
    """The groups of the bucket tensors given (key and bucket size), as Megatron keeps them."""
    found: dict[tuple[int, int], dict[tuple[int, str], dict[int, int]]] = {}
    chained = False
    for fqn, size in fqns_and_sizes:
        parsed = parse(fqn)
        if parsed is None:
            continue
        (sub, group, gbuf, dtype_key, _), bucket = parsed
        chained = chained or fqn.startswith("chained_")
        found.setdefault((sub, group), {}).setdefault((gbuf, dtype_key), {})[bucket] = size
    groups = []
    for (sub, group), buffers in sorted(found.items()):
        dp = layout.expert_dp if sub == 1 else layout.dp
        pad = lcm(dp, 128)
        unpadded, padded = [], []
        for (_, dtype_key), buckets in sorted(buffers.items()):
            sizes = tuple(buckets[b] for b in sorted(buckets))
            unpadded.append((dtype_key, sizes))
            padded.append((dtype_key, tuple(-(-s // pad) * pad for s in sizes)))
        prefix = f"chained_{sub}." if chained else ""
        groups.append(
            BucketGroup(
                f"{prefix}optimizer.distributed.dp_group_idx_{group}.",
                sub,
                tuple(unpadded),
                tuple(padded),
            )
        )
    return groups
