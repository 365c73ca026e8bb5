"""accelerate's ``save_state`` under FSDP2 (``SHARDED_STATE_DICT``: the model's DCP in
``pytorch_model_fsdp_0/``, the optimizer's in ``optimizer_0/``; ``FULL_STATE_DICT``:
``pytorch_model_fsdp.bin`` and ``optimizer.bin``), judged by accelerate and
transformers: accelerate's own training step and ``save_state`` write the checkpoint
(``oracles/accelerate_fsdp_writer``, 2 gloo processes, one CPU shim named there)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.oracle_runner import run_oracle

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ORACLE = "accelerate_fsdp_writer.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("accelerate")
    run_oracle(ORACLE, out, timeout=300)
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("accelerate_full")
    run_oracle(ORACLE, out, "FULL_STATE_DICT", timeout=300)
    return out


def _truth(run: Path) -> dict[str, Any]:
    return torch.load(run / "truth.pt", weights_only=False)


def _logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_save_state_consolidates_to_the_trained_hf_model(saved: Path, tmp_path: Path, cli) -> None:
    """The two DCP directories read as one state dict; with the model's config given, the HF
    output holds the trained weights bit for bit and gives the live model's logits."""
    state = saved / "state"
    info = cli.json("--hf-config", saved / "config.json", "inspect", state)
    paths = {f["path"].split("/")[0] for f in info["files"]}
    assert paths == {"pytorch_model_fsdp_0", "optimizer_0"}
    assert info["optimizer_bytes"] > 0 and info["hf"]["architecture"] == "Qwen3ForCausalLM"
    cli("--hf-config", saved / "config.json", "consolidate", state, tmp_path / "hf")
    truth = _truth(saved)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    for name, want in truth["model"].items():
        assert torch.equal(model.state_dict()[name], want), name
    assert torch.equal(_logits(tmp_path / "hf", truth["input_ids"]), truth["logits"])


def test_save_state_reshards_to_megatron_with_its_adam_state(
    saved: Path, tmp_path: Path, cli
) -> None:
    """A Trainer-style directory (config.json beside the parts, trainer_state.json naming the
    step) needs no flag; the optimizer's moments, kept in their own DCP directory, move with
    the weights."""
    trainer = tmp_path / "checkpoint-1"
    shutil.copytree(saved / "state", trainer)
    shutil.copy(saved / "config.json", trainer)
    (trainer / "trainer_state.json").write_text('{"global_step": 1, "epoch": 0.5}')
    assert cli.json("inspect", trainer)["iteration"] == 1
    cli("reshard", trainer, tmp_path / "meg", "--tp", "2", "--pp", "2")
    report = cli.json("verify", tmp_path / "meg", "--against", trainer)
    assert report["ok"]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg_sq/") for n in names), "Adam state was not carried"
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    cli("consolidate", tmp_path / "meg", tmp_path / "hf")
    truth = _truth(saved)
    assert torch.equal(_logits(tmp_path / "hf", truth["input_ids"]), truth["logits"])


def test_a_missing_optimizer_shard_is_named(saved: Path, tmp_path: Path, cli) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(saved / "state", broken)
    (broken / "optimizer_0" / "__1_0.distcp").unlink()
    result = cli(
        "--hf-config", saved / "config.json", "consolidate", broken, tmp_path / "o", code=3
    )
    assert "optimizer_0/__1_0.distcp" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_full_state_dict_save_converts_with_its_adam_state(
    full: Path, tmp_path: Path, cli
) -> None:
    """FULL_STATE_DICT: the whole model by HF name and FSDP's full optimizer state (by
    parameter name): to HF bit for bit with the live logits, to Megatron with Adam state."""
    state = full / "state"
    shutil.copy(full / "config.json", tmp_path / "config.json")
    info = cli.json("--hf-config", full / "config.json", "inspect", state)
    assert info["format"] == "accelerate" and info["optimizer_bytes"] > 0
    cli("--hf-config", full / "config.json", "consolidate", state, tmp_path / "hf")
    truth = _truth(full)
    assert torch.equal(_logits(tmp_path / "hf", truth["input_ids"]), truth["logits"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    for name, want in truth["model"].items():
        assert torch.equal(model.state_dict()[name], want), name
    cli("--hf-config", full / "config.json", "reshard", state, tmp_path / "meg", "--tp", "2")
    report = cli.json(
        "--hf-config", full / "config.json", "verify", tmp_path / "meg", "--against", state
    )
    assert report["ok"] and any(t["name"].startswith("exp_avg/") for t in report["tensors"])
    result = cli("consolidate", state, tmp_path / "nocfg", code=3)
    assert "--hf-config" in result.stderr


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("accelerate_gpt_oss")
    run_oracle(ORACLE, out, "SHARDED_STATE_DICT", "gpt_oss", timeout=300)
    return out


def test_a_gpt_oss_save_state_converts_with_its_packed_experts(
    gpt_oss: Path, tmp_path: Path, cli
) -> None:
    """GPT-OSS (packed experts, gates and ups interleaved, sinks, biases) through accelerate's
    two DCP directories read as one: to HF the trained weights bit for bit with the live
    model's logits; to Megatron TP2 EP2 with Adam's state, which verifies against the source
    bit for bit, and back to HF byte-identical to the direct conversion."""
    state, config = gpt_oss / "state", gpt_oss / "config.json"
    cli("--hf-config", config, "consolidate", state, tmp_path / "direct")
    truth = _truth(gpt_oss)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "direct"))
    for name, want in truth["model"].items():
        assert torch.equal(model.state_dict()[name], want), name
    logits = _logits(tmp_path / "direct", truth["input_ids"])
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-5)
    meg = tmp_path / "meg"
    cli("--hf-config", config, "reshard", state, meg, "--tp", "2", "--ep", "2", "--etp", "1")
    report = cli.json("--hf-config", config, "verify", meg, "--against", state)
    assert report["ok"]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg/") and "experts" in n for n in names)
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    cli("consolidate", meg, tmp_path / "back")
    back = (tmp_path / "back" / "model.safetensors").read_bytes()
    assert back == (tmp_path / "direct" / "model.safetensors").read_bytes()
