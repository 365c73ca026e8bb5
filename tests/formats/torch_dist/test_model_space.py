"""The distributed optimizer's ``fully_sharded_model_space`` form (issue 52), judged by
megatron-core 0.13.1, the last releases' default writer and loader of it.

megatron-core 0.13.1's own ``DistributedOptimizer`` saves a TP2 GPTModel after one training step
(``tests/oracles/megatron_core_torch_dist_writer.py`` on ``tests/megatron_core_013.py``); its
own ``dist_checkpointing.load`` reshards that to TP1 on load and saves it again: the reference
for ckptctl's reshard. CPU shims (none touches a stored tensor): those of ``mcore_cpu.py``;
``np.product`` (numpy 2 removed it; 0.13 checks flattened shards with it); Adam state made by a
zero-gradient step at learning rate 0 before a load (0.13 has no
``_init_optimizer_states_with_dummy_values``); ``_clean_metadata_for_serialization`` (not in
0.13) as the metadata without its process group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import megatron_core_013
from tests.conftest import Cli

pytest.importorskip("megatron.core", reason="megatron-core's oracle script needs its helpers")

ITER = "iter_0000001"
FLATTENED = "optimizer.state.fp32_param."


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """megatron-core 0.13.1's TP2 DP3 checkpoints after one step: ``ckpt_optim_model_space``
    (each DP rank saves its range of every box: chunks that cut rows) and ``ckpt_optim_dp_zero``
    (``dp_zero_gather_scatter``)."""
    out = tmp_path_factory.mktemp("mcore013")
    sharding = ("fully_sharded_model_space", "dp_zero_gather_scatter")
    megatron_core_013.run(out, "--dp", 3, "--optim-sharding", *sharding)
    return out


@pytest.fixture(scope="module")
def megatron_tp1(written: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """megatron-core 0.13.1's own load of the TP2 DP3 checkpoint into a TP1 DP1 model, saved
    again."""
    out = tmp_path_factory.mktemp("mcore013-tp1")
    source = written / "ckpt_optim_model_space"
    megatron_core_013.run(out, "--load", source, "--tp", "1", "--with-optimizer")
    return out


@pytest.fixture(scope="module")
def ckptctl_tp1(written: Path, mcli: Cli, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckptctl") / "tp1"
    mcli("reshard", written / "ckpt_optim_model_space", out, "--tp", "1", "--dp", "1")
    return out


def tensors(directory: Path, scratch: Path) -> dict[str, Any]:
    """torch's own ``dcp_to_torch_save`` of a torch_dist iteration directory, loaded back."""
    dcp_to_torch_save(directory, scratch)
    return {k: v for k, v in torch.load(scratch, weights_only=False).items() if torch.is_tensor(v)}


def test_masters_read_from_model_space_equal_the_weights(
    written: Path, mcli: Cli, tmp_path: Path
) -> None:
    """An fp32 run's distributed-optimizer masters are its weights: read from the N-D flattened
    boxes and written per parameter, each must equal its weight, which is read another way."""
    source = written / "ckpt_optim_model_space"
    stored = FileSystemReader(source / ITER).read_metadata().state_dict_metadata
    cut = [k for k, m in stored.items() if k.startswith(FLATTENED) and len(m.chunks) > 1]
    # DP ranges cut boxes: a box's elements in several chunks
    assert any(c.sizes[-1] < stored[k].size[-1] for k in cut for c in stored[k].chunks)
    out = tmp_path / "fully"
    mcli("reshard", source, out, "--optim-sharding", "fully_reshardable")
    state = tensors(out / ITER, tmp_path / "all.pt")
    masters = {k[len("optimizer.state.param.") :]: v for k, v in state.items() if ".param." in k}
    assert len(masters) == 9
    for key, master in masters.items():
        assert torch.equal(master, state[key]), key
    moments = [v for k, v in state.items() if k.startswith("optimizer.state.exp_avg.")]
    assert len(moments) == 9 and all(m.abs().sum() > 0 for m in moments)


def test_reshard_equals_megatrons_own_and_megatron_loads_it(
    ckptctl_tp1: Path, megatron_tp1: Path, mcli: Cli, tmp_path: Path
) -> None:
    """TP2 DP3 -> TP1 keeps the form and equals, bit for bit, what megatron-core 0.13.1's load-time
    resharding saves (weights, masters, moments, vocabulary padding rows); megatron-core 0.13.1
    loads ckptctl's output strictly and holds the same state and logits."""
    common = torch.load(ckptctl_tp1 / ITER / "common.pt", weights_only=False)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_sharded_model_space"
    verdict = mcli.json("verify", ckptctl_tp1, "--against", megatron_tp1 / "ckpt")
    against = next(c for c in verdict["checks"] if c["name"] == "against")
    assert against["status"] == "passed", against
    assert "padding rows (1000..1023) equal in 8 tensors" in against["detail"]
    ours = tensors(ckptctl_tp1 / ITER, tmp_path / "ours.pt")
    theirs = tensors(megatron_tp1 / "ckpt" / ITER, tmp_path / "theirs.pt")
    assert sorted(ours) == sorted(theirs)
    assert any(k.startswith(FLATTENED) for k in ours)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key

    loaded = tmp_path / "loaded"
    megatron_core_013.run(loaded, "--load", ckptctl_tp1, "--tp", "1", "--with-optimizer")
    report = json.loads((loaded / "load_report.json").read_text())
    assert report["unexpected_keys"] == []  # what the model asks for, all found
    again = mcli.json("verify", loaded / "ckpt", "--against", megatron_tp1 / "ckpt")
    assert next(c for c in again["checks"] if c["name"] == "against")["status"] == "passed"
    logits = torch.load(loaded / "logits.pt", weights_only=True)["logits"]
    reference = torch.load(megatron_tp1 / "logits.pt", weights_only=True)["logits"]
    assert torch.equal(logits, reference)


def test_round_trip_reproduces_every_flattened_tensor(
    written: Path, ckptctl_tp1: Path, mcli: Cli, tmp_path: Path
) -> None:
    """TP2 DP3 -> TP1 -> TP2 DP3: every tensor of megatron-core's own files, N-D flattened
    optimizer state included, comes back bit for bit."""
    back = tmp_path / "tp2"
    mcli("reshard", ckptctl_tp1, back, "--tp", "2", "--dp", "3")
    source = tensors(written / "ckpt_optim_model_space" / ITER, tmp_path / "src.pt")
    again = tensors(back / ITER, tmp_path / "back.pt")
    assert sorted(source) == sorted(again)
    for key, value in source.items():
        assert torch.equal(again[key], value), key


def test_older_forms_give_the_weights_and_say_the_state_is_not_read(
    written: Path, mcli: Cli
) -> None:
    shown = mcli("inspect", written / "ckpt_optim_dp_zero")
    assert "dp_zero_gather_scatter" in shown.stderr + shown.stdout
    view = mcli.json("inspect", written / "ckpt_optim_dp_zero")
    assert any("only the weights" in w for w in view["warnings"]), view["warnings"]
