"""A dense-first MoE model under pipeline and expert parallelism, judged by megatron-core
0.16.1 itself (``oracles/megatron_core_dense_first_moe.py``, CPU shims as ``mcore_cpu``'s):
its first pipeline stage holds the dense layer alone, where megatron-core keeps a chained
optimizer whose expert part has only empty parameter groups (it gives every rank the groups of
every rank). ckptctl reads such a checkpoint, reshards it to one stage and back, and
megatron-core loads the result (``model.load_state_dict(strict=True)``,
``optimizer.load_state_dict``) to the optimizer it trained, bit for bit: every sub-optimizer's
groups (step, learning rate, weight decay), fp32 weights and Adam moments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.oracle_runner import run_oracle

pytest.importorskip("megatron.core")
ORACLE = "megatron_core_dense_first_moe.py"
RANKS = ("mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dense_first_moe")
    run_oracle(ORACLE, "write", out, timeout=300)
    return out


def _same(a: Any, b: Any, where: str) -> None:
    """Equal, tensors bit for bit (dtype too), containers element by element."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_the_stage_without_experts_round_trips_to_megatron_core(
    trained: Path, tmp_path: Path, cli
) -> None:
    stage0 = torch.load(
        trained / "iter_0000001" / RANKS[0] / "model_optim_rng.pt", weights_only=False
    )
    experts = stage0["optimizer"][1]  # megatron-core's own form, which ckptctl must read
    assert [len(g["params"]) for g in experts["param_groups"]] == [0]

    cli("reshard", trained, tmp_path / "one", "--pp", "1")
    assert cli.json("verify", tmp_path / "one", "--against", trained)["ok"]
    layout = ("--pp", "2", "--pp-first-stage-layers", "1")
    cli("reshard", tmp_path / "one", tmp_path / "again", *layout)
    run_oracle(ORACLE, "load", tmp_path / "again", tmp_path / "loaded", timeout=300)
    for rank in RANKS:
        want = torch.load(trained / f"truth_{rank}.pt", weights_only=False)
        got = torch.load(tmp_path / "loaded" / f"truth_{rank}.pt", weights_only=False)
        assert want["sub_optimizers"] == 2  # chained on every stage
        _same(want, got, rank)


def test_the_distributed_optimizer_of_such_a_stage_is_refused(
    trained: Path, tmp_path: Path, cli
) -> None:
    """megatron-core's DistributedOptimizer cannot save that stage in the legacy format (its
    ``state_dict`` asserts a step in the empty expert optimizer): nothing to resume from."""
    layout = ("--pp", "2", "--pp-first-stage-layers", "1", "--distributed-optimizer")
    result = cli("reshard", trained, tmp_path / "out", *layout, "--dp", "2", code=2)
    assert "stage(s) [0] hold no MoE layer" in result.stderr
    assert "--no-distributed-optimizer" in result.stderr
    assert not (tmp_path / "out").exists()
