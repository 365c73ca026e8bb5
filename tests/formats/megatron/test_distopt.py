"""Megatron's distributed optimizer (``distrib_optim.pt``): replayed, resharded across TP, PP and
DP bit-exactly, converted to and from per-parameter state, and checked against files written by
megatron-core's own DistributedOptimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptctl import synth
from tests import megatron_core_013
from tests.oracle_runner import run_oracle
from tests.pipeline.test_reshard import _assert_tree_equal, assert_same_checkpoint

WRITER = "megatron_core_distopt_writer.py"


@pytest.fixture(scope="module")
def model_and_states():
    config = synth.tiny_llama_config(
        hidden_size=40, intermediate_size=50, num_heads=4, num_kv_heads=2, num_layers=4
    )
    model = synth.make_model(config, seed=11)
    return model, synth.adam_step(model, seed=12)


def _dist(root: Path, model_and_states, **kwargs) -> Path:
    model, states = model_and_states
    synth.write_megatron(model, states, root, distributed_optimizer=True, **kwargs)
    return root


def test_tp2_pp2_dp2_to_tp1_pp4_dp4_and_back_is_bit_exact(tmp_path, cli, model_and_states):
    a = _dist(tmp_path / "a", model_and_states, tp=2, pp=2, dp=2, bucket_size=700)
    cli("reshard", a, tmp_path / "b", "--tp", "1", "--pp", "4", "--dp", "4")
    assert (tmp_path / "b/iter_0000001/mp_rank_00_003/distrib_optim.pt").exists()
    cli("reshard", tmp_path / "b", tmp_path / "a2", "--tp", "2", "--pp", "2", "--dp", "2")
    assert_same_checkpoint(a, tmp_path / "a2")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_distributed_state_equals_generator_per_parameter_state(tmp_path, cli, tied):
    config = synth.tiny_llama_config(
        hidden_size=40,
        intermediate_size=50,
        num_heads=4,
        num_kv_heads=2,
        num_layers=4,
        tie_word_embeddings=tied,
    )
    model = synth.make_model(config, seed=3)
    states = synth.adam_step(model, seed=4)
    synth.write_megatron(
        model,
        states,
        tmp_path / "dist",
        tp=2,
        pp=2,
        vpp=2,
        dp=3,
        distributed_optimizer=True,
        param_group_order="wd_first",
    )
    synth.write_megatron(
        model, states, tmp_path / "plain", tp=1, pp=1, param_group_order="wd_first"
    )
    cli("consolidate", tmp_path / "dist", tmp_path / "full", "--format", "megatron")
    rel = "iter_0000001/mp_rank_00/model_optim_rng.pt"
    got = torch.load(tmp_path / "full" / rel, weights_only=False)
    want = torch.load(tmp_path / "plain" / rel, weights_only=False)
    _assert_tree_equal(got["model"], want["model"], "model")
    _assert_tree_equal(got["optimizer"]["state"], want["optimizer"]["state"], "state")
    assert [g["params"] for g in got["optimizer"]["param_groups"]] == [
        g["params"] for g in want["optimizer"]["param_groups"]
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_parameter_to_distributed_and_back(tmp_path, cli, model_and_states, dtype):
    model, states = model_and_states
    synth.write_megatron(
        model, states, tmp_path / "a", tp=2, pp=2, params_dtype=dtype, param_group_order="wd_first"
    )
    cli(
        "reshard",
        tmp_path / "a",
        tmp_path / "b",
        "--tp",
        "1",
        "--pp",
        "2",
        "--dp",
        "2",
        "--distributed-optimizer",
    )
    _dist(tmp_path / "direct", model_and_states, tp=1, pp=2, dp=2, params_dtype=dtype)
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        rel = f"iter_0000001/{rank}/distrib_optim.pt"
        _assert_tree_equal(
            torch.load(tmp_path / "b" / rel), torch.load(tmp_path / "direct" / rel), rel
        )
    cli(
        "reshard",
        tmp_path / "b",
        tmp_path / "a2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--no-distributed-optimizer",
    )
    assert_same_checkpoint(tmp_path / "a", tmp_path / "a2")


def test_unreplayable_layout_is_refused(tmp_path, cli, model_and_states):
    a = _dist(tmp_path / "a", model_and_states, tp=2, pp=2, dp=2, bucket_size=700)
    path = a / "iter_0000001/mp_rank_00_000/model_optim_rng.pt"
    data = torch.load(path, weights_only=False)
    data["args"].ddp_bucket_size = 1  # not what the buffers were built with
    torch.save(data, path)
    result = cli("reshard", a, tmp_path / "b", "--tp", "1", code=3)
    assert "replaying the layout gives" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.oracle
@pytest.mark.parametrize("release", ["0.16.1", megatron_core_013.RELEASE])
def test_megatron_core_distributed_optimizer_files(tmp_path, cli, release):
    """A real DistributedOptimizer (TP2 PP2 DP2, one training step) is the writer; the live
    optimizer's per-parameter state is the truth. Written by megatron-core 0.16.1 and by 0.13.1
    (``distrib_optim.pt`` as releases before 0.14 save it)."""
    pytest.importorskip("megatron.core")
    real = tmp_path / "real"
    flags = ("--tp", 2, "--pp", 2, "--dp", 2, "--hidden", 48, "--ffn-hidden", 100)
    if release == megatron_core_013.RELEASE:
        megatron_core_013.run(real, *flags, script=WRITER)
    else:
        run_oracle(WRITER, real, *flags)
    # Same layout, per-parameter torch state: every parameter's state must equal the truth.
    cli("reshard", real, tmp_path / "plain", "--tp", "2", "--pp", "2", "--no-distributed-optimizer")
    for tp in range(2):
        for pp in range(2):
            truth = torch.load(real / f"truth_tp{tp}_pp{pp}.pt", weights_only=True)
            data = torch.load(
                tmp_path / f"plain/iter_0000001/mp_rank_0{tp}_00{pp}/model_optim_rng.pt",
                weights_only=False,
            )
            names = [n for n in data["model"] if not n.endswith("_extra_state")]
            state = data["optimizer"]["state"]
            order = [
                n
                for kind in (False, True)
                for n in names
                if (n.endswith(".bias") or data["model"][n].dim() == 1) == kind
            ]
            assert sorted(order) == sorted(truth)
            for index, name in enumerate(order):
                # Vocabulary padding rows (past the true 1000) are no tokens: ckptctl zeroes them.
                real_rows = slice(None)
                if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    rows = truth[name]["param"].shape[0]
                    real_rows = slice(0, max(0, min(rows, 1000 - tp * rows)))
                for ours, key in (
                    (state[index]["exp_avg"], "exp_avg"),
                    (state[index]["exp_avg_sq"], "exp_avg_sq"),
                    (data["model"][name], "param"),
                ):
                    assert torch.equal(ours[real_rows], truth[name][key][real_rows]), (name, key)
    # Across TP, PP and DP and back, then to per-parameter state again: bit-exact.
    cli("reshard", real, tmp_path / "b", "--tp", "1", "--pp", "4", "--dp", "4")
    cli("reshard", tmp_path / "b", tmp_path / "back", "--tp", "2", "--pp", "2", "--dp", "2")
    cli(
        "reshard",
        tmp_path / "back",
        tmp_path / "plain2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--no-distributed-optimizer",
    )
    assert_same_checkpoint(tmp_path / "plain", tmp_path / "plain2")
