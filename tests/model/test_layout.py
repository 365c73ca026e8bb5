"""Pure layout model and geometry: validation messages, stage placement, piece coverage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ckptctl.errors import LayoutError
from ckptctl.model.catalog import parameters
from ckptctl.model.geometry import Split, overlap, shard_shape_and_pieces
from ckptctl.model.layout import ModelSpec, ParallelLayout

SPEC = ModelSpec(
    num_layers=8,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    vocab_size=1100,
)


def test_tp_not_dividing_query_groups_names_both_numbers() -> None:
    with pytest.raises(LayoutError, match="tp=4 does not divide num_query_groups=2"):
        ParallelLayout(tp=4).check_against(SPEC)


def test_all_problems_reported_together() -> None:
    with pytest.raises(LayoutError) as info:
        ParallelLayout(tp=8, pp=3).check_against(SPEC)
    text = str(info.value)
    assert "num_query_groups=2" in text and "num_attention_heads=4" in text and "pp=3" in text


MOE = ModelSpec.model_validate({**SPEC.model_dump(), "num_experts": 8, "moe_ffn_hidden_size": 48})


def test_expert_layout_problems_name_the_values() -> None:
    with pytest.raises(LayoutError) as info:
        ParallelLayout(ep=3, dp=3, tp=1).check_against(MOE)
    assert "ep=3 does not divide num_experts=8" in str(info.value)
    with pytest.raises(LayoutError, match="etp=32 does not divide the expert ffn size 48"):
        ParallelLayout(tp=1, dp=32, etp=32).check_against(MOE)
    with pytest.raises(ValidationError, match="ep=4 x etp=2 does not divide tp=2 x dp=2"):
        ParallelLayout(tp=2, dp=2, ep=4)
    with pytest.raises(LayoutError, match="ep=2 / etp=None need a mixture-of-experts model"):
        ParallelLayout(dp=2, ep=2).check_against(SPEC)
    with pytest.raises(ValidationError, match=r"moe_router_topk=9 must lie in 1\.\.num_experts=8"):
        ModelSpec.model_validate({**MOE.model_dump(), "moe_router_topk": 9})
    with pytest.raises(ValidationError, match="moe_ffn_hidden_size is set but num_experts is not"):
        ModelSpec.model_validate({**SPEC.model_dump(), "moe_ffn_hidden_size": 8})


def test_global_expert_index_is_ep_rank_times_local_count_plus_local_index() -> None:
    layout = ParallelLayout(tp=2, dp=8, ep=4)
    assert layout.expert_dp == 2
    assert [list(layout.local_experts(MOE, r)) for r in range(4)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    experts = [p for p in parameters(MOE) if p.expert is not None]
    assert len(experts) == 8 * 8 * 2  # layers x experts x (fc1, fc2)
    fc1 = next(p for p in experts if p.name.endswith("local_experts.5.linear_fc1.weight"))
    assert fc1.shape == (96, 64) and fc1.split is Split.GATED and fc1.expert == 5


def test_json_round_trip() -> None:
    layout = ParallelLayout(tp=2, pp=4, vpp=2, dp=3, distributed_optimizer=True)
    assert ParallelLayout.model_validate_json(layout.model_dump_json()) == layout
    assert ModelSpec.model_validate_json(SPEC.model_dump_json()) == SPEC


@pytest.mark.parametrize(("tp", "expected"), [(1, 1152), (2, 1280), (4, 1536), (8, 2048)])
def test_vocab_padding_per_tp(tp: int, expected: int) -> None:
    assert SPEC.padded_vocab_size(tp) == expected


def test_vpp_chunks_follow_megatron_offsets() -> None:
    chunks = ParallelLayout(pp=2, vpp=2).chunk_layers(8)
    assert chunks == {
        (0, 0): range(0, 2),
        (1, 0): range(2, 4),
        (0, 1): range(4, 6),
        (1, 1): range(6, 8),
    }


def test_uneven_stages() -> None:
    chunks = ParallelLayout(pp=3, first_stage_layers=2, last_stage_layers=2).chunk_layers(8)
    assert [chunks[(s, 0)] for s in range(3)] == [range(0, 2), range(2, 6), range(6, 8)]
    with pytest.raises(LayoutError, match="do not fit"):
        ParallelLayout(pp=2, first_stage_layers=5, last_stage_layers=5).chunk_layers(8)


def test_swiglu_shard_holds_gate_then_up_rows() -> None:
    local, pieces = shard_shape_and_pieces(Split.GATED, (8, 3), tp=2, rank=1)
    assert local == (4, 3)
    assert [(p.local, p.canonical, p.sizes) for p in pieces] == [
        ((0, 0), (2, 0), (2, 3)),
        ((2, 0), (6, 0), (2, 3)),
    ]


def test_vocab_shard_past_true_vocab_is_padding() -> None:
    local, pieces = shard_shape_and_pieces(Split.VOCAB, (1100, 4), tp=8, rank=7, padded_rows=2048)
    assert local == (256, 4) and pieces == ()
    local, pieces = shard_shape_and_pieces(Split.VOCAB, (1100, 4), tp=8, rank=4, padded_rows=2048)
    assert pieces[0].canonical == (1024, 0) and pieces[0].sizes == (76, 4)


@settings(max_examples=200, deadline=None)
@given(
    split=st.sampled_from(list(Split)),
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    tp=st.sampled_from([1, 2, 3, 4]),
)
def test_shards_tile_the_canonical_tensor_exactly_once(
    split: Split, rows: int, cols: int, tp: int
) -> None:
    """Every canonical element is held by exactly one TP rank (all ranks, if replicated)."""
    shape = (rows * 2 * tp, cols * tp)
    padded = shape[0] + 2 * tp if split is Split.VOCAB else None
    # PARTS: unequal parts, each a multiple of tp (gated delta net's q, k, v, z, beta, alpha)
    parts = (tp, shape[0] - 2 * tp, tp) if split is Split.PARTS and rows > 1 else (shape[0],)
    counts = [[0] * shape[1] for _ in range(shape[0])]
    for rank in range(tp):
        local, pieces = shard_shape_and_pieces(split, shape, tp, rank, padded, parts)
        for p in pieces:
            assert all(lo + n <= m for lo, n, m in zip(p.local, p.sizes, local, strict=True))
            for i in range(p.sizes[0]):
                for j in range(p.sizes[1]):
                    counts[p.canonical[0] + i][p.canonical[1] + j] += 1
    expected = tp if split is Split.REPLICATED else 1
    assert all(c == expected for row in counts for c in row)


def test_overlap_maps_boxes_between_layouts() -> None:
    _, (target,) = shard_shape_and_pieces(Split.ROW, (4, 8), tp=2, rank=1)
    _, (source,) = shard_shape_and_pieces(Split.ROW, (4, 8), tp=4, rank=2)
    copy = overlap(target, source)
    assert copy is not None
    assert (copy.src, copy.dst, copy.sizes) == ((0, 0), (0, 0), (4, 2))
    _, (other,) = shard_shape_and_pieces(Split.ROW, (4, 8), tp=4, rank=0)
    assert overlap(target, other) is None


def test_catalog_counts() -> None:
    names = [p.name for p in parameters(SPEC)]
    assert len(names) == 1 + 8 * 6 + 2
    assert len(set(names)) == len(names)
    tied = SPEC.model_copy(update={"tie_embeddings": True})
    assert "output_layer.weight" not in [p.name for p in parameters(tied)]
