"""Placing ``dp_reshardable`` grad-buffer buckets on parameters (``formats/torch_dist/
dp_reshardable.py``), without a checkpoint: the flat-range boxes, and the refusals when the
replayed layout does not match the buckets saved. (Real buckets, written by megatron-core 0.16.1
and Megatron-LM 0.19.2, are judged against their fully_reshardable twins in test_dcp.py and
test_megatron_lm.py.)"""

from __future__ import annotations

from dataclasses import replace
from math import prod

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_container.metadata import Chunk, TensorEntry
from ckptctl.formats.megatron_common.distopt_layout import is_bucket_key
from ckptctl.formats.megatron_common.layout import ExpertNaming
from ckptctl.formats.megatron_common.sharded_keys import torch_dist_files
from ckptctl.formats.torch_dist import dp_reshardable
from ckptctl.formats.torch_dist.dp_reshardable_targets import with_buckets
from ckptctl.model.catalog import Naming
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import OptimizerLayout
from ckptctl.model.stored import StoredTensor

SPEC = ModelSpec(
    num_layers=2,
    hidden_size=16,
    ffn_hidden_size=32,
    num_attention_heads=2,
    num_query_groups=2,
    kv_channels=8,
    vocab_size=100,
)
DISTRIBUTED = OptimizerLayout(states=(), distributed=True)


@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=3).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)),
            st.integers(0, prod(shape)).flatmap(
                lambda lo: st.tuples(st.just(lo), st.integers(lo, prod(shape)))
            ),
        )
    )
)
def test_flat_boxes_cover_a_flat_range_once_in_order(case) -> None:
    shape, (lo, hi) = case
    covered = []
    for offsets, sizes, first in dp_reshardable.flat_boxes(shape, lo, hi):
        assert len(offsets) == len(sizes) == len(shape)
        elements = [
            sum(index * prod(shape[d + 1 :]) for d, index in enumerate(_unravel(n, sizes, offsets)))
            for n in range(prod(sizes))
        ]
        # each box is contiguous in memory and starts where it says
        assert elements == list(range(first, first + prod(sizes)))
        covered += elements
    assert covered == list(range(lo, hi))


def _unravel(n: int, sizes: tuple[int, ...], offsets: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(sizes):
        out.append(n % size)
        n //= size
    return [o + i for o, i in zip(offsets, reversed(out), strict=True)]


def _buckets(size: int) -> dict[str, TensorEntry]:
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32)"
    return {
        f"{key}.bucket_idx_0.{state}": TensorEntry(
            dtype="float32", shape=(size,), chunks=(Chunk(offsets=(0,), sizes=(size,)),)
        )
        for state in ("param", "exp_avg", "exp_avg_sq")
    }


def _numel() -> int:
    layout = ParallelLayout(distributed_optimizer=True)
    placed = dp_reshardable.place(
        _buckets(10**6), SPEC, layout, DISTRIBUTED, "float32", Naming.LOCAL
    )
    return max(t.view_offset + prod(t.shape) for t in placed)


def test_buckets_of_the_replayed_size_are_placed_whole() -> None:
    layout = ParallelLayout(distributed_optimizer=True)
    size = _numel()
    placed = dp_reshardable.place(
        _buckets(size), SPEC, layout, DISTRIBUTED, "float32", Naming.LOCAL
    )
    states = {t.canonical.split("/")[0] for t in placed}
    assert states == {"fp32_param", "exp_avg", "exp_avg_sq"}


def test_a_bucket_shorter_than_the_replay_is_refused() -> None:
    layout = ParallelLayout(distributed_optimizer=True)
    with pytest.raises(CheckpointError, match="grad-buffer layout does not match"):
        dp_reshardable.place(
            _buckets(_numel() - 64), SPEC, layout, DISTRIBUTED, "float32", Naming.LOCAL
        )


def test_buckets_of_another_model_parallel_rank_are_refused() -> None:
    layout = ParallelLayout(distributed_optimizer=True)
    buckets = _buckets(_numel())
    buckets |= {k.replace("dp_group_idx_0", "dp_group_idx_1"): v for k, v in buckets.items()}
    with pytest.raises(CheckpointError, match="belong to no parameter"):
        dp_reshardable.place(buckets, SPEC, layout, DISTRIBUTED, "float32", Naming.LOCAL)


def test_a_key_that_is_no_bucket_is_refused() -> None:
    layout = ParallelLayout(distributed_optimizer=True)
    with pytest.raises(CheckpointError, match="not a bucket"):
        dp_reshardable.place(
            {"optimizer.distributed.other": TensorEntry(dtype="float32", shape=(1,), chunks=())},
            SPEC,
            layout,
            DISTRIBUTED,
            "float32",
            Naming.LOCAL,
        )


MOE = ModelSpec(**{**SPEC.model_dump(), "num_experts": 4, "moe_router_topk": 2})


@pytest.mark.parametrize(
    ("spec", "layout"),
    [
        (SPEC, ParallelLayout(tp=2, dp=2, distributed_optimizer=True)),
        (SPEC, ParallelLayout(pp=2, dp=4, distributed_optimizer=True)),
        (MOE, ParallelLayout(dp=2, ep=2, distributed_optimizer=True)),
    ],
    ids=["tp2-dp2", "pp2-dp4", "ep2-dp2"],
)
def test_written_buckets_are_read_back_where_they_were_written(
    spec: ModelSpec, layout: ParallelLayout
) -> None:
    """The bucket chunks a dp_reshardable target is written as (``with_buckets``), described as
    a checkpoint's metadata would describe them, are placed by the reader on the same
    parameter elements: writer and reader replay one layout."""
    files = torch_dist_files(spec, layout, "iter_0000001", "float32", (), Naming.TE)
    written = with_buckets(
        files, spec, layout, DISTRIBUTED, "float32", Naming.TE, ExpertNaming.SEQUENTIAL
    )
    chunks = [t for f in written for t in f.tensors if is_bucket_key(str(t.key[0]))]
    experts = [t for t in chunks if str(t.key[0]).startswith("chained_1.")]
    assert chunks and bool(experts) == (layout.ep > 1)
    boxes: dict[str, list[Chunk]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for chunk in chunks:
        fqn = str(chunk.key[0])
        boxes.setdefault(fqn, []).append(
            Chunk(offsets=(int(chunk.key[1]),), sizes=(prod(chunk.shape),))
        )
        assert chunk.base_shape is not None
        shapes[fqn] = chunk.base_shape
    entries = {
        fqn: TensorEntry(dtype="float32", shape=shapes[fqn], chunks=tuple(found))
        for fqn, found in boxes.items()
    }
    chained = replace(DISTRIBUTED, chained=layout.ep > 1)
    placed = dp_reshardable.place(entries, spec, layout, chained, "float32", Naming.TE)

    def elements(tensors: list[StoredTensor]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        return sorted((t.canonical, p.canonical, p.sizes) for t in tensors for p in t.pieces)

    assert elements(placed) == elements(chunks)
    covered = sum(prod(t.shape) for t in chunks)
    assert covered <= sum(shape[0] for shape in shapes.values())
