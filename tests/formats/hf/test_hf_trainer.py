"""The HF Trainer's ``checkpoint-N/`` directories, judged by transformers' own ``Trainer``
(``oracles/hf_trainer_writer``: two steps on CPU): the index-keyed ``optimizer.pt`` must map
onto the very moments the live optimizer held for each named parameter (``reference/``, saved
by name with torch's DCP)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.oracle_runner import run_oracle

pytest.importorskip("transformers")
ORACLE = "hf_trainer_writer.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained(tmp_path_factory: pytest.TempPathFactory, *args: str) -> Path:
    out = tmp_path_factory.mktemp("trainer_" + "_".join(args))
    run_oracle(ORACLE, out, *args, timeout=300)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _trained(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q/k/v biases: vectors outside the norms, in the Trainer's no-decay group."""
    return _trained(tmp_path_factory, "qwen2")


@pytest.mark.parametrize("run", ["llama", "qwen2"])
def test_a_trainer_checkpoint_reshards_to_megatron_with_its_adam_state(
    run: str, request: pytest.FixtureRequest, tmp_path: Path, cli
) -> None:
    trained: Path = request.getfixturevalue(run)
    shown = cli.json("inspect", trained / "checkpoint-2")
    assert shown["iteration"] == 2  # trainer_state.json's global_step
    cli("reshard", trained / "checkpoint-2", tmp_path / "meg", "--tp", "2", "--pp", "2")
    report = cli.json("verify", tmp_path / "meg", "--against", trained / "reference")
    assert report["ok"]
    assert report["against"]["compared"] == report["against"]["held"][1]
    names = {t["name"] for t in report["tensors"]}
    assert "exp_avg_sq/decoder.layers.1.self_attention.linear_qkv.weight" in names
    assert "exp_avg/decoder.final_layernorm.weight" in names
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])


def test_another_optimizers_state_is_left_out_and_said(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, cli
) -> None:
    trained = _trained(tmp_path_factory, "llama", "adafactor")
    shown = cli.json("inspect", trained / "checkpoint-2")
    assert any("not torch's Adam" in n for n in shown["notes"])
    result = cli("reshard", trained / "checkpoint-2", tmp_path / "meg", "--tp", "2")
    assert "weights only" in result.stdout + result.stderr


def test_accelerates_save_state_without_fsdp_reshards_with_its_adam_state(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, cli
) -> None:
    """accelerate's ``save_state`` of a plain model: ``model.safetensors`` (no config: given
    with --hf-config) and ``optimizer.bin``, one group over ``model.parameters()``."""
    trained = _trained(tmp_path_factory, "llama", "accelerate")
    given = ("--hf-config", trained / "config" / "config.json")
    cli(*given, "reshard", trained / "state", tmp_path / "meg", "--tp", "2")
    report = cli.json("verify", tmp_path / "meg", "--against", trained / "reference")
    assert report["ok"] and report["against"]["compared"] == report["against"]["held"][1]
    assert any(t["name"].startswith("exp_avg_sq/") for t in report["tensors"])
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
