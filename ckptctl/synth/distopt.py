"""The synthetic distributed-optimizer state: Megatron-Core's grad-buffer layout replayed by
hand (>= 0.8: reverse order, 64-element alignment, buckets padded to lcm(dp, 128)) and the
coalesced ``distrib_optim.pt``. Part of the test oracle (see ``ckptctl.synth``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ckptctl.synth.model import (
    _BUCKET_END_ALIGN,
    _DISTRIB_KEYS,
    _PARAM_START_ALIGN,
)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _grad_buffer_layout(
    numels: list[int], shared: list[bool], dp: int, bucket_size: int | None
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]], list[int]]:
    """Replay megatron-core's ``_ParamAndGradBuffer`` layout with the distributed optimizer (S4.5).

    ``numels`` / ``shared`` describe one buffer's parameters in ``named_parameters()`` order
    (``shared`` = the ``shared_embedding`` attribute). Parameters are placed from last to first
    (backprop order), each start rounded up to a multiple of 64; a bucket is closed once it holds
    ``>= bucket_size`` elements (``None``: never), and its end is padded to a multiple of
    ``lcm(dp, 128)``. A shared embedding gets a bucket of its own: an open bucket is closed at the
    (aligned) position before it, and its own bucket is closed right after it.

    Returns ``(index, buckets, unpadded)``: ``index[i] = (start, end, bucket)`` of parameter ``i``
    in buffer coordinates, ``buckets[b] = (start, padded end)``, ``unpadded[b]`` = bucket size
    before end padding (intra-bucket alignment gaps included).
    """
    end_multiple = math.lcm(dp, _BUCKET_END_ALIGN)
    index: list[tuple[int, int, int]] = [(0, 0, 0)] * len(numels)
    buckets: list[tuple[int, int]] = []
    unpadded: list[int] = []
    bucket_start = 0

    def close(end: int) -> int:
        nonlocal bucket_start
        unpadded.append(end - bucket_start)
        padded_end = _round_up(end, end_multiple)
        buckets.append((bucket_start, padded_end))
        bucket_start = padded_end
        return padded_end

    pos = 0
    is_open = False
    for i in reversed(range(len(numels))):
        pos = _round_up(pos, _PARAM_START_ALIGN)
        if shared[i] and is_open:
            pos = close(pos)
        start, end = pos, pos + numels[i]
        index[i] = (start, end, len(buckets))
        is_open = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared[i]:
            pos = close(end)
            is_open = False
        else:
            pos = end
    if is_open:
        close(pos)
    return index, buckets, unpadded


def _distrib_optim_state(
    chunks: list[dict[str, torch.Tensor]],
    chunk_states: list[dict[str, dict[str, torch.Tensor]]],
    *,
    params_dtype: torch.dtype,
    dp: int,
    bucket_sizes: list[int | None],
    shared_names: set[str],
) -> dict[object, object]:
    """``distrib_optim.pt`` of one (tp, pp) rank: the coalesced DP-zero format (S4.2).

    One grad buffer per model chunk (all parameters share one dtype and none is expert-parallel),
    keyed ``(param_dtype, torch.float32)``. Its world tensors are the buckets of
    :func:`_grad_buffer_layout` with their end padding stripped, concatenated: each parameter's
    fp32 master weight, ``exp_avg`` and ``exp_avg_sq`` (local TP shard, flattened row-major) at
    ``[base(bucket) + start - bucket_start, ... + numel)``, zeros in the alignment gaps.
    """
    state: dict[object, object] = {"buckets_coalesced": True}
    for gbuf_idx, (weights, states) in enumerate(zip(chunks, chunk_states, strict=True)):
        names = list(weights)
        index, buckets, unpadded = _grad_buffer_layout(
            [weights[n].numel() for n in names],
            [n in shared_names for n in names],
            dp,
            bucket_sizes[gbuf_idx],
        )
        base = [sum(unpadded[:b]) for b in range(len(unpadded))]
        total = sum(unpadded)
        tensors = {key: torch.zeros(total, dtype=torch.float32) for key in _DISTRIB_KEYS}
        for name, (start, end, b) in zip(names, index, strict=True):
            lo = base[b] + start - buckets[b][0]
            hi = lo + end - start
            for key, source in _DISTRIB_KEYS.items():
                tensor = states[name][source]
                assert tensor.dtype == torch.float32 and tensor.numel() == end - start
                tensors[key][lo:hi] = tensor.reshape(-1)
        world: dict[str, object] = {**tensors, "numel_unpadded": total}
        state[gbuf_idx] = {(params_dtype, torch.float32): world}
    return state


def _distributed_optimizer_state_dict(torch_state: dict[str, Any]) -> dict[str, object]:
    """``DistributedOptimizer.state_dict()``: the param groups without ``params`` (S4.1).

    The tensors live in ``distrib_optim.pt``. Megatron stores the common Adam step in each group:
    a float with ``torch.optim.Adam`` (whose group keys these are; ``step.item()``), an ``int``
    with TE / Apex FusedAdam. No ``grad_scaler`` key: megatron-core adds one only when a grad
    scaler exists (fp16, or a constant loss scale), never for bf16 or fp32.
    """
    steps = {float(st["step"]) for st in torch_state["state"].values()}
    assert len(steps) == 1
    step = steps.pop()
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "step": step}
        for group in torch_state["param_groups"]
    ]
    return {"optimizer": {"param_groups": groups}}
