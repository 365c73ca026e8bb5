"""DCP checkpoints of HF models (FSDP2 training of ``LlamaForCausalLM``), judged by torch and
transformers: torch's FSDP2 writes the checkpoint (``oracles/fsdp2_hf_llama_writer``, 2 gloo
processes, one Adam step), transformers runs what ckptctl makes of it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.oracle_runner import run_oracle

transformers = pytest.importorskip("transformers")

ORACLE = "fsdp2_hf_llama_writer.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2")
    run_oracle(ORACLE, out, timeout=300)
    return out


@pytest.fixture(scope="module")
def truth(fsdp2: Path) -> dict[str, Any]:
    return torch.load(fsdp2 / "truth.pt", weights_only=False)


def _hf(directory: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    )


def test_fsdp2_dcp_consolidates_to_the_trained_hf_model(
    fsdp2: Path, truth: dict[str, Any], tmp_path: Path, cli
) -> None:
    """config.json beside the DCP files says what model it is; every parameter and the logits
    of the consolidated model equal the live FSDP2 model's after its step, bit for bit."""
    cli("consolidate", fsdp2 / "dcp", tmp_path / "hf")
    model = _hf(tmp_path / "hf")
    state = model.state_dict()
    for name, want in truth["model"].items():
        assert torch.equal(state[name], want), name
    with torch.no_grad():
        logits = model(input_ids=truth["input_ids"]).logits
    assert torch.equal(logits, truth["logits"])


def test_fsdp2_dcp_reshards_to_megatron_with_its_adam_state(
    fsdp2: Path, truth: dict[str, Any], tmp_path: Path, cli
) -> None:
    cli("reshard", fsdp2 / "dcp", tmp_path / "meg", "--tp", "2", "--pp", "2")
    report = cli.json("verify", tmp_path / "meg", "--against", fsdp2 / "dcp")
    assert report["ok"]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg_sq/") for n in names), "Adam state was not carried"
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    cli("consolidate", tmp_path / "meg", tmp_path / "hf")
    with torch.no_grad():
        logits = _hf(tmp_path / "hf")(input_ids=truth["input_ids"]).logits
    assert torch.equal(logits, truth["logits"])


def test_without_its_config_an_hf_dcp_asks_for_one(fsdp2: Path, tmp_path: Path, cli) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(fsdp2 / "dcp", bare)
    (bare / "config.json").unlink()
    result = cli("consolidate", bare, tmp_path / "hf", code=2)
    assert "--hf-config" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    cli("--hf-config", fsdp2 / "dcp" / "config.json", "consolidate", bare, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").exists()
