"""Megatron's distributed-optimizer buffer layout, replayed. Pure.

``distrib_optim.pt`` stores, per grad buffer, the fp32 master weights and Adam moments of every
parameter of a model chunk as flat tensors with no names. Where each parameter lies follows from
the buffer layout Megatron-Core (>= 0.8) builds: parameters from last to first, each start
aligned to 64 elements, buckets closed at the bucket size, each bucket padded to a multiple of
lcm(dp, 128); the stored flat tensor concatenates buckets with their end padding stripped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import lcm

PARAM_ALIGNMENT = 64


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True, slots=True)
class BufferLayout:
    offsets: dict[str, int]
    """Parameter name -> start of its elements in the stored (bucket-padding-stripped) tensor."""
    bucket_unpadded: tuple[int, ...]
    numel_unpadded: int


def replay_buffer(
    params: list[tuple[str, int]],
    *,
    dp: int,
    bucket_size: int | None,
    shared_embedding: str | None = None,
    pad_for_busbw: bool = False,
) -> BufferLayout:
    """Lay out ``params`` ((name, numel) in ``named_parameters`` order) as Megatron does."""
    pad = lcm(dp, 128, 2**16) if pad_for_busbw else lcm(dp, 128)
    starts: dict[str, tuple[int, int]] = {}  # name -> (start in buffer, bucket)
    buckets: list[tuple[int, int]] = []  # (start, unpadded size)
    pos = bucket_start = 0
    is_open = False
    end = 0

    def close(at: int) -> None:
        nonlocal bucket_start, is_open
        buckets.append((bucket_start, at - bucket_start))
        bucket_start = _round_up(at, pad)
        is_open = False

    for name, numel in reversed(params):
        pos = _round_up(pos, PARAM_ALIGNMENT)
        shared = name == shared_embedding
        if shared and is_open:
            close(pos)
            pos = bucket_start
        start, end = pos, pos + numel
        starts[name] = (start, len(buckets))
        is_open = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            close(end)
            pos = bucket_start
        else:
            pos = end
    if is_open:
        close(end)
    base, bases = 0, []
    for _, unpadded in buckets:
        bases.append(base)
        base += unpadded
    offsets = {name: bases[b] + start - buckets[b][0] for name, (start, b) in starts.items()}
    return BufferLayout(offsets, tuple(u for _, u in buckets), base)


# --- the distributed optimizer's keys in torch_dist checkpoints -------------------------------

DP_RESHARDABLE_PREFIX = "optimizer.distributed."
"""Keys of ``dp_reshardable`` optimizer state: raw grad-buffer buckets of one TP/PP layout."""

CHAINED = re.compile(r"^chained_\d+\.")
"""megatron-core's ``ChainedOptimizer`` (dense, then expert parameters) prefixes each
optimizer's keys with ``chained_<i>.``."""


def chained_prefix(fqn: str) -> str:
    """``chained_<i>.`` when ``fqn`` is one of a chained optimizer's keys, else ``""``."""
    found = CHAINED.match(fqn)
    return found.group(0) if found else ""


def is_bucket_key(fqn: str) -> bool:
    """Whether ``fqn`` is ``dp_reshardable`` state (a bucket, or an object kept beside them) of
    the distributed optimizer, or of one of a chained optimizer's (``chained_<i>.``)."""
    return CHAINED.sub("", fqn).startswith(DP_RESHARDABLE_PREFIX)
