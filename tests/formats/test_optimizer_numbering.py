"""Optimizer state dicts keyed by parameter index (verl's per-rank files, accelerate's): the
index names a parameter only when one group numbers them all in the model's order, and only
torch's Adam state is carried. Anything else is refused naming the file, never guessed."""

from __future__ import annotations

import pytest

from ckptctl.errors import CheckpointError
from ckptctl.formats.hf_state_dict_files import optimizer_tensors

PARAMS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


@pytest.mark.parametrize(
    "groups",
    [
        [{"params": [0, 2]}, {"params": [1]}],  # decay first, as the HF Trainer groups them
        [{"params": [2, 1, 0]}],
        [{"params": [0, 1]}],
    ],
)
def test_an_index_numbering_that_is_not_the_models_order_is_refused(groups: list) -> None:
    tree = {"state": {}, "param_groups": groups}
    with pytest.raises(CheckpointError, match="which index is which parameter"):
        optimizer_tensors(tree, PARAMS, "optim.pt", 0)


def test_another_optimizers_state_is_refused() -> None:
    tree = {"state": {0: {"state1": None, "step": None}}, "param_groups": [{"params": [0, 1, 2]}]}
    with pytest.raises(CheckpointError, match="state1"):
        optimizer_tensors(tree, PARAMS, "optim.pt", 0)


def test_the_models_order_in_one_group_is_taken() -> None:
    tree = {"state": {}, "param_groups": [{"params": [0, 1, 2]}]}
    assert optimizer_tensors(tree, PARAMS, "optim.pt", 0) == []
