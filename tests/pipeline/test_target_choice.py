"""``planners.target``: the target of a reshard is what was given, and the source's value for
everything else; a kept value that cannot hold yields, with a note. Pure and fast."""

from __future__ import annotations

import pytest

from ckptctl.errors import UsageError
from ckptctl.model.layout import ModelSpec, ParallelLayout
from planners.target import changes, choose_target

DENSE = ModelSpec(
    num_layers=8,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=8,
    num_query_groups=4,
    kv_channels=8,
    vocab_size=1000,
)
MOE = DENSE.model_copy(update={"num_experts": 4})


def test_nothing_given_keeps_everything() -> None:
    source = ParallelLayout(
        tp=2,
        pp=4,
        dp=2,
        vpp=2,
        first_stage_layers=2,
        last_stage_layers=2,
        distributed_optimizer=True,
    )
    choice = choose_target(source, DENSE, {})
    assert choice.layout == source and choice.notes == ()


def test_what_is_given_replaces_only_itself() -> None:
    source = ParallelLayout(tp=2, pp=2, dp=2, vpp=2, distributed_optimizer=True)
    layout = choose_target(source, DENSE, {"tp": 1, "pp": None}).layout
    assert (layout.tp, layout.pp, layout.dp, layout.vpp) == (1, 2, 2, 2)
    assert layout.distributed_optimizer


def test_a_new_pipeline_depth_drops_the_uneven_split_with_a_note() -> None:
    source = ParallelLayout(pp=4, first_stage_layers=1, last_stage_layers=1)
    choice = choose_target(source, DENSE, {"pp": 2})
    assert choice.layout.first_stage_layers is None and choice.layout.last_stage_layers is None
    assert any("stage split: even over PP2" in n for n in choice.notes)


def test_a_kept_split_yields_to_a_given_virtual_pipeline() -> None:
    source = ParallelLayout(pp=4, first_stage_layers=1, last_stage_layers=1)
    choice = choose_target(source, DENSE, {"vpp": 2})  # 1 layer per stage cannot be split
    assert choice.layout.vpp == 2 and choice.layout.first_stage_layers is None
    assert any("do not fit what was given" in n for n in choice.notes)


def test_a_kept_virtual_pipeline_that_does_not_fit_falls_with_a_note() -> None:
    choice = choose_target(ParallelLayout(pp=2, vpp=4), DENSE, {"pp": 4})  # 2 layers a stage
    assert choice.layout.vpp == 1 and any("VPP4 does not divide" in n for n in choice.notes)
    choice = choose_target(ParallelLayout(pp=2, vpp=2), DENSE, {"pp": 1})
    assert choice.layout.vpp == 1 and any("needs PP > 1" in n for n in choice.notes)


def test_even_stages_is_asked_for_by_name() -> None:
    source = ParallelLayout(pp=4, first_stage_layers=1, last_stage_layers=1)
    assert choose_target(source, DENSE, {"even_stages": True}).layout.first_stage_layers is None
    with pytest.raises(UsageError, match="contradict"):
        choose_target(source, DENSE, {"even_stages": True, "first_stage_layers": 2})


def test_expert_tp_as_tp_follows_tp_and_an_own_value_is_kept() -> None:
    follows = choose_target(ParallelLayout(tp=2, dp=2, ep=2), MOE, {"tp": 1}).layout
    assert follows.etp is None and follows.expert_tp == 1
    own = choose_target(ParallelLayout(tp=2, dp=2, ep=2, etp=1), MOE, {"tp": 4}).layout
    assert own.etp == 1
    same = choose_target(ParallelLayout(tp=2, dp=2, ep=2), MOE, {"etp": 2}).layout
    assert same.etp is None  # "as TP", however it was said


def test_changes_say_what_differs() -> None:
    before = ParallelLayout(tp=2, pp=2)
    after = ParallelLayout(tp=1, pp=2, distributed_optimizer=True)
    assert changes(before, after) == ["TP 2 -> 1", "distributed optimizer off -> on"]
    assert changes(before, before) == []
