"""verl Megatron actor checkpoints (``dist_ckpt/`` of megatron-core's ``torch_dist`` without
Megatron-LM's args, ``huggingface/config.json`` and ``transformer_config.json`` beside it; verl
0.9's split layout, ``model/``, ``optimizer/``, ``extra/`` with ``ckpt_contents.json``),
judged by megatron-core and transformers: ``oracles/verl_megatron_writer`` trains a step at
TP 2 on megatron-core 0.13.1 (the release verl's Megatron images pin) and saves as verl's
``MegatronCheckpointManager`` does; the HF model ckptctl writes gives megatron-core's logits."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ckptctl.errors import CheckpointError
from ckptctl.formats.torch_dist.joined import joined_view
from ckptctl.pipeline.probe import open_checkpoint
from tests import megatron_core_013

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verl_megatron")
    megatron_core_013.run(out, script="verl_megatron_writer.py")
    return out


def _actor(run: Path) -> Path:
    return run / "global_step_1" / "actor"


def test_an_actor_checkpoint_becomes_the_trained_hf_model(run: Path, tmp_path: Path, cli) -> None:
    info = cli.json("inspect", _actor(run))
    assert info["format"] == "torch_dist" and info["iteration"] == 1
    assert info["layout"]["tp"] == 2 and info["has_optimizer"]
    assert info["hf"]["architecture"] == "LlamaForCausalLM"
    cli("consolidate", _actor(run), tmp_path / "hf")
    reference = torch.load(run / "logits.pt", weights_only=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"]).logits
    # megatron-core's TP forward and transformers' differ by fp32 rounding only
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)


def test_an_actor_checkpoint_reshards_with_its_adam_state(run: Path, tmp_path: Path, cli) -> None:
    cli("reshard", _actor(run), tmp_path / "tp1", "--tp", "1", "--format", "megatron")
    report = cli.json("verify", tmp_path / "tp1", "--against", _actor(run))
    assert report["ok"]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg_sq/") for n in names), "Adam state was not carried"


def test_what_does_not_describe_the_run_is_refused_by_name(run: Path, tmp_path: Path, cli) -> None:
    other = tmp_path / "other"
    shutil.copytree(_actor(run), other)
    saved = json.loads((other / "transformer_config.json").read_text())
    saved["num_query_groups"] = 4
    (other / "transformer_config.json").write_text(json.dumps(saved))
    result = cli("consolidate", other, tmp_path / "o1", code=3)
    assert "num_query_groups" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = cli("consolidate", _actor(run) / "dist_ckpt", tmp_path / "o2", code=3)
    assert "actor directory" in result.stderr
    (other / "huggingface" / "config.json").unlink()
    result = cli("consolidate", other, tmp_path / "o3", code=3)
    assert "huggingface/config.json" in result.stderr and "--hf-config" in result.stderr


@pytest.fixture(scope="module")
def split_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """verl 0.9.1's split layout (``model/``, ``optimizer/``, ``extra/`` apart, with
    ``ckpt_contents.json``), saved by megatron-core as its checkpoint manager makes the calls."""
    out = tmp_path_factory.mktemp("verl_megatron_v2")
    megatron_core_013.run(out, "v2", script="verl_megatron_writer.py")
    return out


def test_a_split_actor_becomes_the_trained_hf_model(split_run: Path, tmp_path: Path, cli) -> None:
    """verl 0.9's layout: the model's and the optimizer's torch_dist directories read as one;
    verl saves no HF config with it (without Megatron-Bridge), so it is asked for by name."""
    actor = _actor(split_run)
    config = split_run / "hf_config.json"
    result = cli("inspect", actor, code=3)
    assert "--hf-config" in result.stderr and "LlamaForCausalLM" in result.stderr
    info = cli.json("inspect", actor, "--hf-config", config)
    assert info["format"] == "torch_dist" and info["iteration"] == 1
    assert info["layout"]["tp"] == 2 and info["has_optimizer"]
    assert any("rng_state (extra/dist_ckpt/" in w for w in info["warnings"])
    files = {f["path"].split("/")[0] for f in info["files"]}
    assert files == {"model", "optimizer"}
    cli("consolidate", actor, tmp_path / "hf", "--hf-config", config)
    reference = torch.load(split_run / "logits.pt", weights_only=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"]).logits
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)


def test_a_split_actor_reshards_with_its_adam_state(split_run: Path, tmp_path: Path, cli) -> None:
    actor, config = _actor(split_run), split_run / "hf_config.json"
    cli(
        "reshard",
        actor,
        tmp_path / "tp1",
        "--tp",
        "1",
        "--format",
        "megatron",
        "--hf-config",
        config,
    )
    report = cli.json("verify", tmp_path / "tp1", "--against", actor, "--hf-config", config)
    assert report["ok"]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg_sq/") for n in names), "Adam state was not carried"
    assert any(not n.startswith(("exp_avg", "fp32_param")) for n in names), "weights not compared"


def test_a_split_manifest_that_leaves_the_checkpoint_is_refused(
    split_run: Path, tmp_path: Path, cli
) -> None:
    other = tmp_path / "actor"
    shutil.copytree(_actor(split_run), other)
    manifest = json.loads((other / "ckpt_contents.json").read_text())
    config = split_run / "hf_config.json"
    for path in ("../../elsewhere", "/etc"):
        manifest["contents"]["optimizer"]["path"] = path
        (other / "ckpt_contents.json").write_text(json.dumps(manifest))
        result = cli("inspect", other, "--hf-config", config, code=3)
        assert "contents.optimizer.path" in result.stderr
    manifest["contents"]["optimizer"]["path"] = "optimizer/dist_ckpt"
    manifest["schema_version"] = 3
    (other / "ckpt_contents.json").write_text(json.dumps(manifest))
    result = cli("inspect", other, "--hf-config", config, code=3)
    assert "schema_version 3" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_split_lora_run_without_adapter_shards_is_refused(
    split_run: Path, tmp_path: Path, cli
) -> None:
    """A manifest saying LoRA (``backend.peft``) over a ``model/dist_ckpt`` that holds no
    Megatron-Bridge adapter: refused by name, not read as the trained model (the read of a
    real LoRA run's shards is ``tests/lora/test_megatron_lora.py``'s)."""
    other = tmp_path / "actor"
    shutil.copytree(_actor(split_run), other)
    manifest = json.loads((other / "ckpt_contents.json").read_text())
    manifest["backend"]["peft"] = True
    (other / "ckpt_contents.json").write_text(json.dumps(manifest))
    config = ("--hf-config", split_run / "hf_config.json")
    result = cli("consolidate", other, tmp_path / "out", *config, code=3)
    assert "saved by a LoRA run (backend.peft), but holds no Megatron-Bridge adapter" in (
        result.stderr
    )
    assert not (tmp_path / "out").exists()


def _becomes_the_trained_model(out: Path, actor: Path, dst: Path, cli) -> None:
    """``actor`` consolidates to the HF model whose logits are megatron-core's."""
    cli("consolidate", actor, dst)
    reference = torch.load(out / "logits.pt", weights_only=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(dst), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"]).logits
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)


def _joined(info: dict, weights: str) -> None:
    """``inspect``'s report of an actor whose weights and optimizer state were saved apart."""
    assert info["format"] == "torch_dist" and info["iteration"] == 1
    assert info["layout"]["tp"] == 2 and info["has_optimizer"]
    assert f"{weights}/model.safetensors" in {f["path"] for f in info["files"]}
    assert not any("optimizer state" in w for w in info["warnings"]), info["warnings"]


def _moves_as_megatron_core_saved_it(actor: Path, reference: Path, tmp_path: Path, cli) -> None:
    """``actor`` resharded to Megatron TP1 equals, bit for bit, weights and Adam state, the same
    run saved by megatron-core with its model (the oracle trains deterministically)."""
    cli("reshard", actor, tmp_path / "tp1", "--tp", "1", "--format", "megatron")
    against = ("--against", reference)
    config = ("--hf-config", reference.parent.parent / "hf_config.json")
    given = config if config[1].is_file() else ()
    report = cli.json("verify", tmp_path / "tp1", *against, *given)
    assert report["ok"]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg_sq/") for n in names), "Adam state was not carried"
    assert any(not n.startswith(("exp_avg", "fp32_param")) for n in names), "weights not compared"


def _a_weight_the_state_lacks_is_refused(actor: Path) -> None:
    """The join's own check, on the real views: optimizer state whose parameter the weights
    do not hold is refused by name, not carried without it."""
    joined = open_checkpoint(str(actor))
    weights = open_checkpoint(str(actor / "model" / "huggingface")).view
    inside = "model/huggingface/"
    state = replace(
        joined.view, files=tuple(f for f in joined.view.files if not f.path.startswith(inside))
    )
    dropped = "decoder.layers.1.mlp.linear_fc2.weight"
    files = tuple(
        replace(f, tensors=tuple(t for t in f.tensors if t.canonical != dropped))
        for f in weights.files
    )
    assert joined_view(state, weights, "model/huggingface").files == joined.view.files
    with pytest.raises(CheckpointError, match=f"holds no {dropped}, whose exp_avg"):
        joined_view(state, replace(weights, files=files), "model/huggingface")


def test_a_split_actor_saved_through_a_bridge_joins_its_hf_weights_and_adam_state(
    split_run: Path, tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """verl 0.9.1's default (a bridge, ``use_dist_checkpointing`` off): the manifest names
    ``model/huggingface`` for the weights, which mbridge 0.15.1 wrote there (the oracle's
    ``v2-hf``), and ``optimizer/dist_ckpt`` for the optimizer state alone: the two are read as
    one checkpoint. HF output gives megatron-core's logits; Megatron TP1 equals the same run
    saved with its model (``v2``). The same run with LoRA (``backend.peft``, the PEFT adapter
    Megatron-Bridge exports named by ``peft_adapter_path``): refused naming that directory for
    merge-lora."""
    out = tmp_path_factory.mktemp("verl_megatron_v2_hf")
    megatron_core_013.run(out, "v2-hf", script="verl_megatron_writer.py", mbridge=True)
    actor = _actor(out)
    _joined(cli.json("inspect", actor), "model/huggingface")
    _becomes_the_trained_model(out, actor, out / "hf", cli)
    _moves_as_megatron_core_saved_it(actor, _actor(split_run), out, cli)
    _a_weight_the_state_lacks_is_refused(actor)
    manifest = json.loads((actor / "ckpt_contents.json").read_text())
    manifest["backend"]["peft"] = True
    manifest["contents"]["model"]["peft_adapter_path"] = "model/huggingface/adapter"
    (actor / "ckpt_contents.json").write_text(json.dumps(manifest))
    result = cli("consolidate", actor, out / "dst", code=3)
    assert f"merge {actor / 'model' / 'huggingface' / 'adapter'} into" in result.stderr
    assert "merge-lora BASE ADAPTER DST" in result.stderr


def test_an_actor_saved_through_a_bridge_joins_its_hf_weights_and_adam_state(
    run: Path, tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """verl's single-directory layout saved through a bridge (``use_dist_checkpointing``
    off): ``dist_ckpt`` holds the optimizer state alone (megatron-core's own save of verl's
    state dict without its model) and ``huggingface/`` the weights mbridge 0.15.1 wrote (the
    oracle's ``hf``): read as one, as the same run saved with its model (``v1``) is; without
    the weights it is refused, saying the save kept none."""
    out = tmp_path_factory.mktemp("verl_megatron_hf")
    megatron_core_013.run(out, "hf", script="verl_megatron_writer.py", mbridge=True)
    actor = _actor(out)
    _joined(cli.json("inspect", actor), "huggingface")
    _becomes_the_trained_model(out, actor, out / "dst", cli)
    _moves_as_megatron_core_saved_it(actor, _actor(run), out, cli)
    (actor / "huggingface" / "model.safetensors").unlink()
    result = cli("inspect", actor, code=3)
    assert "holds the optimizer state alone" in result.stderr
    assert "holds no weights either" in result.stderr
