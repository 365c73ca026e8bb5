"""``planners.load``: the per-rank decision of ``ckptctl.load`` (pure; no files)."""

from __future__ import annotations

from math import prod

from planners.load import Need, StoredChunk, StoredTensor, overlap, plan_load

SHAPE = (8, 6)


def rows(n_ranks: int, file: str = "__{r}_0.distcp") -> StoredTensor:
    """``SHAPE`` split by rows over ``n_ranks``, one file per rank."""
    per = SHAPE[0] // n_ranks
    chunks = tuple(
        StoredChunk((r * per, 0), (per, SHAPE[1]), file.format(r=r)) for r in range(n_ranks)
    )
    return StoredTensor("float32", SHAPE, chunks)


def need(rank: int, n_ranks: int, dim: int = 0) -> Need:
    per = SHAPE[dim] // n_ranks
    offsets = (rank * per, 0) if dim == 0 else (0, rank * per)
    sizes = (per, SHAPE[1]) if dim == 0 else (SHAPE[0], per)
    return Need("w", "float32", SHAPE, offsets, sizes)


def covered(decision, box: Need) -> int:
    return sum(prod(r.size) for r in decision.reads if r.fqn == box.fqn)


def test_the_same_layout_reads_each_box_whole_from_its_own_file() -> None:
    decision = plan_load([need(1, 2)], {"w": rows(2)})
    assert decision.strategy == "direct" and not decision.problems
    assert decision.files == (("sharded", "__1_0.distcp"),)
    (read,) = decision.reads
    assert read.whole_chunk and read.need_start == (0, 0)


def test_fewer_ranks_assemble_boxes_from_whole_chunks() -> None:
    box = need(0, 2)
    decision = plan_load([box], {"w": rows(4)})
    assert decision.strategy == "reshard"
    assert [r.need_start for r in decision.reads] == [(0, 0), (2, 0)]
    assert covered(decision, box) == prod(box.sizes)


def test_another_split_dimension_reads_only_the_overlapping_columns() -> None:
    box = need(1, 2, dim=1)  # columns 3..5 of every row
    decision = plan_load([box], {"w": rows(2)})
    assert decision.strategy == "reshard"
    assert [(r.chunk_start, r.size) for r in decision.reads] == [((0, 3), (4, 3))] * 2
    assert covered(decision, box) == prod(box.sizes)


def test_lost_files_fall_back_to_the_full_checkpoint_only_where_needed() -> None:
    full = {"w": StoredTensor("float32", SHAPE, (StoredChunk((0, 0), SHAPE, "full.pt"),))}
    lost = frozenset({"__1_0.distcp"})
    mine = plan_load([need(0, 2)], {"w": rows(2)}, lost, full)
    assert mine.strategy == "direct" and mine.files == (("sharded", "__0_0.distcp"),)
    theirs = plan_load([need(1, 2)], {"w": rows(2)}, lost, full)
    assert theirs.strategy == "from-full" and theirs.files == (("full", "full.pt"),)
    assert theirs.reads[0].chunk_start == (4, 0)
    alone = plan_load([need(1, 2)], {"w": rows(2)}, lost)
    assert alone.problems and "__1_0.distcp" in alone.problems[0]


def test_what_cannot_be_filled_is_named() -> None:
    other = Need("w", "bfloat16", SHAPE, (0, 0), SHAPE)
    missing = Need("v", "float32", (2,), (0,), (2,))
    decision = plan_load([other, missing], {"w": rows(2)})
    assert decision.problems == (
        "w: the checkpoint holds float32 [8, 6], the state dict expects bfloat16 [8, 6]",
        "v: not in the checkpoint",
    )


def test_empty_boxes_read_nothing_and_scalars_read_whole() -> None:
    empty = Need("w", "float32", SHAPE, (8, 0), (0, 6))
    scalar = Need("s", "int64", (), (), ())
    stored = {"w": rows(2), "s": StoredTensor("int64", (), (StoredChunk((), (), "__0_0.distcp"),))}
    decision = plan_load([empty, scalar], stored)
    assert decision.strategy == "direct" and [r.fqn for r in decision.reads] == ["s"]


def test_overlap_is_symmetric_in_volume() -> None:
    a = StoredChunk((2, 1), (4, 4), "f")
    b = Need("w", "float32", SHAPE, (3, 0), (5, 3))
    chunk_start, need_start, size = overlap(a, b)  # type: ignore[misc]
    assert (chunk_start, need_start, size) == ((1, 0), (0, 1), (3, 2))
    assert overlap(StoredChunk((0, 0), (2, 6), "f"), b) is None


def test_retention_keeps_the_newest_locally_and_every_nth_in_the_lake() -> None:
    import pytest

    from planners.retention import Retention

    policy = Retention(keep_local=2, lake_every=10)
    assert policy.local_to_remove([30, 10, 20, 40]) == [10, 20]
    assert policy.local_to_remove([40]) == []
    assert [s for s in range(0, 35, 5) if policy.goes_to_lake(s)] == [0, 10, 20, 30]
    assert not Retention(lake_every=0).goes_to_lake(10)
    assert all(Retention().goes_to_lake(s) for s in (1, 2, 3))
    with pytest.raises(ValueError, match="keep_local=0"):
        Retention(keep_local=0)
