"""A checkpoint trained with its LoRA adapter in it (verl's actor with ``lora_rank > 0``: PEFT's
``get_peft_model`` before FSDP2), judged by PEFT: ``oracles/verl_fsdp_writer qwen3_lora`` trains
a step on 3 gloo ranks (the rank-8 matrices cut 3 / 3 / 2 rows) and records PEFT's own adapter
state dict, its config and ``merge_and_unload`` of the trained model. ``merge-lora`` merges the
adapter bit-equal to PEFT; ``--adapter-only`` writes the adapter PEFT itself would save, which
PEFT loads over the base to the trained model's logits exactly. No CPU shim beyond the verl
oracle's own (its docstring)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.oracle_runner import run_oracle

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
ALPHA = "16"  # the oracle's LoraConfig(lora_alpha=16), recorded in lora_train_meta.json


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verl_lora")
    run_oracle("verl_fsdp_writer.py", "qwen3_lora", out, 3, timeout=300)
    return out


def _actor(run: Path) -> Path:
    return run / "global_step_1" / "actor"


def _truth(run: Path) -> dict[str, Any]:
    return torch.load(run / "truth.pt", weights_only=False)


def _contents(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_the_merge_equals_peft_merge_and_unload(run: Path, tmp_path: Path, cli) -> None:
    before = _contents(_actor(run))
    cli("merge-lora", _actor(run), tmp_path / "hf")  # the alpha from lora_train_meta.json
    truth = _truth(run)
    written = load_file(tmp_path / "hf" / "model.safetensors")
    tied = {"lm_head.weight"}  # Qwen3 ties it to the embedding: saved once
    assert set(written) == set(truth["merged"]) - tied
    for name, tensor in written.items():
        assert torch.equal(tensor, truth["merged"][name]), name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        logits = model(input_ids=truth["input_ids"]).logits
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-5)
    assert _contents(_actor(run)) == before


def test_the_adapter_exports_as_peft_saves_it(run: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "adapter"
    summary = cli.json("merge-lora", _actor(run), out, "--adapter-only", "--lora-alpha", ALPHA)
    assert summary["modules"] == 14 and summary["r"] == 8 and summary["lora_alpha"] == 16
    truth = _truth(run)
    saved = load_file(out / "adapter_model.safetensors")
    assert set(saved) == set(truth["adapter"])
    for name, tensor in saved.items():
        assert torch.equal(tensor, truth["adapter"][name]), name
    config = json.loads((out / "adapter_config.json").read_text())
    want = truth["adapter_config"]
    for field in ("r", "lora_alpha", "target_modules", "bias", "use_rslora"):
        assert config[field] == want[field], field
    # PEFT loads it over the base weights the checkpoint holds: the trained model's logits.
    base = {
        name.removeprefix("base_model.model.").replace(".base_layer.", "."): tensor
        for name, tensor in truth["model"].items()
        if ".lora_" not in name
    }
    hf_config = transformers.AutoConfig.from_pretrained(str(_actor(run) / "huggingface"))
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    model.float().load_state_dict(base)
    wrapped = peft.PeftModel.from_pretrained(model, str(out))
    with torch.no_grad():
        logits = wrapped(input_ids=truth["input_ids"]).logits
    assert torch.equal(logits, truth["unsharded_logits"])
    # An alpha other than the run recorded: refused by name.
    result = cli("merge-lora", _actor(run), tmp_path / "a8", "--lora-alpha", "8", code=2)
    assert "lora_train_meta.json" in result.stderr and "16" in result.stderr
    # A second export into it: refused, then replaced with --overwrite.
    result = cli("merge-lora", _actor(run), out, "--adapter-only", code=2)
    assert "--overwrite" in result.stderr
    cli("merge-lora", _actor(run), out, "--adapter-only", "--overwrite")
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 16


def test_the_base_alone_is_not_taken_for_the_trained_model(run: Path, tmp_path: Path, cli) -> None:
    info = cli.json("inspect", _actor(run))
    assert info["adapter"]["modules"] == 14 and info["adapter"]["ranks"] == [8]
    assert not info["has_optimizer"]  # a LoRA run's optimizer numbers the wrapped model's
    result = cli("consolidate", _actor(run), tmp_path / "base", code=3)
    assert "LoRA adapter trained on 14 modules" in result.stderr
    assert "merge-lora" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "base").exists()
    # verl before 0.9 recorded no alpha: it must be given, and is taken as given.
    older = tmp_path / "older"
    shutil.copytree(_actor(run), older)
    (older / "lora_train_meta.json").unlink()
    result = cli("merge-lora", older, tmp_path / "m", code=2)
    assert "--lora-alpha" in result.stderr
    cli("merge-lora", older, tmp_path / "a8", "--adapter-only", "--lora-alpha", "8")
    assert json.loads((tmp_path / "a8" / "adapter_config.json").read_text())["lora_alpha"] == 8
    plain = tmp_path / "plain"
    cli("merge-lora", _actor(run), plain, "--lora-alpha", ALPHA)
    result = cli("merge-lora", plain, tmp_path / "m2", "--lora-alpha", ALPHA, code=2)
    assert "holds no LoRA adapter" in result.stderr
    result = cli("merge-lora", plain, tmp_path / "a", tmp_path / "m3", "--adapter-only", code=2)
    assert "--adapter-only" in result.stderr


@pytest.fixture(scope="module")
def lora_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """verl's ``save_lora_only``: each rank's model file holds the adapter alone."""
    out = tmp_path_factory.mktemp("verl_lora_only")
    run_oracle("verl_fsdp_writer.py", "qwen3_lora", out, 3, "lora_only", timeout=300)
    return out


def test_an_adapter_saved_alone_merges_into_the_base_it_was_trained_on(
    lora_only: Path, tmp_path: Path, cli
) -> None:
    actor, truth = _actor(lora_only), _truth(lora_only)
    info = cli.json("inspect", actor)
    assert info["adapter"]["alone"] and info["adapter"]["lora_alpha"] == 16
    result = cli("consolidate", actor, tmp_path / "x", code=3)
    assert f"merge-lora BASE {actor} DST" in result.stderr
    result = cli("merge-lora", actor, tmp_path / "y", code=2)
    assert "without its base weights" in result.stderr
    # The model the run started from, saved by transformers (the trained base: LoRA froze it).
    config = transformers.AutoConfig.from_pretrained(str(actor / "huggingface"))
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.float().load_state_dict(
        {
            name.removeprefix("base_model.model.").replace(".base_layer.", "."): tensor
            for name, tensor in truth["model"].items()
            if ".lora_" not in name
        }
    )
    model.save_pretrained(tmp_path / "base")
    cli("merge-lora", tmp_path / "base", actor, tmp_path / "merged")
    written = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(written) == set(truth["merged"]) - {"lm_head.weight"}  # tied: saved once
    for name, tensor in written.items():
        assert torch.equal(tensor, truth["merged"][name]), name
    cli("merge-lora", actor, tmp_path / "adapter", "--adapter-only")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(saved) == set(truth["adapter"])
    for name, tensor in saved.items():
        assert torch.equal(tensor, truth["adapter"][name]), name


def test_a_second_adapter_or_a_dora_run_is_refused_by_name(run: Path, tmp_path: Path) -> None:
    from ckptctl.errors import CheckpointError
    from ckptctl.model.peft_wrapped import split

    names = list(_truth(run)["model"])
    split(names, "ok")  # the oracle's names split cleanly
    dora = [
        *names,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight",
    ]
    with pytest.raises(CheckpointError, match="lora_magnitude_vector"):
        split(dora, "x")
    second = [n.replace(".default.", ".other.") for n in names if ".lora_" in n]
    with pytest.raises(CheckpointError, match="'default', 'other'"):
        split([*names, *second], "x")


@pytest.fixture(scope="module", params=["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def accelerate_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """accelerate's ``save_state`` of a PEFT-wrapped Qwen3 under FSDP2 (DCP directories, or
    one full state dict file), from ``oracles/accelerate_fsdp_writer``."""
    out = tmp_path_factory.mktemp(f"accelerate_lora_{request.param}")
    run_oracle("accelerate_fsdp_writer.py", out, request.param, "lora", timeout=300)
    return out


def test_an_accelerate_lora_run_merges_and_exports_as_peft(
    accelerate_run: Path, tmp_path: Path, cli
) -> None:
    state, config = accelerate_run / "state", accelerate_run / "config.json"
    truth = torch.load(accelerate_run / "truth.pt", weights_only=False)
    result = cli("--hf-config", config, "consolidate", state, tmp_path / "base", code=3)
    assert "merge-lora" in result.stderr
    cli("--hf-config", config, "merge-lora", state, tmp_path / "hf", "--lora-alpha", "8")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(written) == set(truth["merged"])
    for name, tensor in written.items():
        assert torch.equal(tensor, truth["merged"][name]), name
    args = ("--hf-config", config, "merge-lora", state, tmp_path / "adapter")
    cli(*args, "--adapter-only", "--lora-alpha", "8")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(saved) == set(truth["adapter"])
    for name, tensor in saved.items():
        assert torch.equal(tensor, truth["adapter"][name]), name
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager"
    )
    base.load_state_dict(
        {
            name.removeprefix("base_model.model.").replace(".base_layer.", "."): tensor
            for name, tensor in truth["model"].items()
            if ".lora_" not in name
        }
    )
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    with torch.no_grad():
        logits = model(input_ids=truth["input_ids"]).logits
    assert torch.equal(logits, truth["unsharded_logits"])
