"""Megatron-Bridge's LoRA as verl's Megatron workers save it (``actor/adapter_checkpoint``),
judged by megatron-core's forward of the LoRA model and by PEFT.

``oracles/megatron_bridge_lora_writer.py`` applies Megatron-Bridge 0.3.1's own ``LoRA`` to
megatron-core 0.16.1's ``GPTModel`` on gloo CPU ranks and saves the adapter file for file as
verl does (its CPU shims are in its docstring: megatron-core's CUDA calls on CPU, Megatron-Bridge's
``peft`` imported without its package ``__init__`` and with a stand-in for
TransformerEngine while it is imported). ``merge-lora`` of it into its base must give the model
whose logits megatron-core computed with the adapter on; its PEFT export, loaded by PEFT over
the HF base, the same; PEFT's ``merge_and_unload`` of that export equals ckptctl's merge bit for
bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import megatron_bridge_peft

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("megatron.core")

ALPHA = "16"  # the oracle's LoRA(alpha=16): verl keeps it in its run config, not in the files


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TP 2: the adapter trained 3 Adam steps; ``logits.pt`` is megatron-core's forward;
    ``actor/`` the same run as verl 0.9 saves it under ``use_dist_checkpointing``."""
    out = tmp_path_factory.mktemp("bridge_lora_tp2")
    megatron_bridge_peft.run(out, "--tp", 2, "--pp", 1, "--mode", "train", "--split")
    return out


def _logits(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _contents(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def test_the_merge_is_the_model_megatron_trained(trained: Path, tmp_path: Path, cli) -> None:
    before = _contents(trained)
    cli("merge-lora", trained / "base", trained, tmp_path / "merged", "--lora-alpha", ALPHA)
    truth = torch.load(trained / "logits.pt")
    logits = _logits(tmp_path / "merged", truth["input_ids"])
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-5)
    # the adapter matters: the base alone is far from the trained model
    cli("consolidate", trained / "base", tmp_path / "base", "--format", "hf")
    assert (_logits(tmp_path / "base", truth["input_ids"]) - truth["logits"]).abs().max() > 0.1
    assert _contents(trained) == before


def test_an_hf_base_and_the_peft_export_agree_with_peft(trained: Path, tmp_path: Path, cli) -> None:
    cli("consolidate", trained / "base", tmp_path / "hf_base", "--format", "hf")
    hf_base, adapter = tmp_path / "hf_base", tmp_path / "adapter"
    cli("merge-lora", hf_base, trained, tmp_path / "merged", "--lora-alpha", ALPHA)
    cli("merge-lora", trained / "base", trained, tmp_path / "from_megatron", "--lora-alpha", ALPHA)
    merged = _tensors(tmp_path / "merged")
    from_megatron = _tensors(tmp_path / "from_megatron")
    assert set(merged) == set(from_megatron)
    assert all(torch.equal(merged[n], from_megatron[n]) for n in merged)

    summary = cli.json(
        "merge-lora", hf_base, trained, adapter, "--adapter-only", "--lora-alpha", ALPHA
    )
    # 4 layers x (q, k, v, o, gate, up, down): fused QKV and gate/up cut into HF's modules
    assert summary["modules"] == 28 and summary["r"] == 8 and summary["lora_alpha"] == 16
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16

    truth = torch.load(trained / "logits.pt")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_base), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        logits = model(input_ids=truth["input_ids"]).logits
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-5)
    unloaded = model.merge_and_unload().state_dict()
    assert set(merged) <= set(unloaded)
    for name, tensor in merged.items():
        assert torch.equal(tensor, unloaded[name]), name


def test_verl_split_lora_run_merges_its_own_adapter_shards(
    trained: Path, tmp_path: Path, cli
) -> None:
    """verl 0.9's split layout of the LoRA run under ``use_dist_checkpointing``: the base and
    Megatron-Bridge's adapter in one ``torch_dist`` directory (``model/dist_ckpt``, the
    adapter's keys stacked over the layers). ``merge-lora ACTOR DST`` merges the adapter into
    the actor's own base: the model megatron-core trained, and bit for bit what merging the
    same run's per-rank adapter files into its legacy base gives; ``--adapter-only`` exports
    the same PEFT adapter; converting the base alone is refused naming merge-lora."""
    actor = trained / "actor"
    before = _contents(trained)
    cli("consolidate", trained / "base", tmp_path / "base_hf")  # verl saved no HF config
    config = ("--hf-config", tmp_path / "base_hf" / "config.json")
    result = cli("consolidate", actor, tmp_path / "no", *config, code=3)
    assert "merge-lora" in result.stderr and "16 modules" in result.stderr
    assert "rank 8" in cli("inspect", actor, *config).stdout

    cli("merge-lora", actor, tmp_path / "merged", "--lora-alpha", ALPHA, *config)
    truth = torch.load(trained / "logits.pt")
    logits = _logits(tmp_path / "merged", truth["input_ids"])
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-5)
    cli("merge-lora", trained / "base", trained, tmp_path / "files", "--lora-alpha", ALPHA)
    merged, from_files = _tensors(tmp_path / "merged"), _tensors(tmp_path / "files")
    assert set(merged) == set(from_files)
    assert all(torch.equal(merged[n], from_files[n]) for n in merged)

    cli("merge-lora", actor, tmp_path / "a", "--adapter-only", "--lora-alpha", ALPHA, *config)
    cli(
        "merge-lora",
        trained / "base",
        trained,
        tmp_path / "b",
        "--adapter-only",
        "--lora-alpha",
        ALPHA,
    )
    exported, from_files = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert set(exported) == set(from_files) and len(exported) == 56
    assert all(torch.equal(exported[n], from_files[n]) for n in exported)
    assert _contents(trained) == before


def test_pipeline_stages_number_their_layers_from_zero(tmp_path: Path, cli) -> None:
    """At PP 2 each stage saves its layers as 0, 1: placed at the stage's offset (from
    ``transformer_config.json``), the merge gives the model megatron-core computes at PP 1
    with the same adapter (its matrices seeded by their global names)."""
    staged, reference = tmp_path / "pp2", tmp_path / "pp1"
    megatron_bridge_peft.run(staged, "--tp", 2, "--pp", 2, "--mode", "seeded")
    cli("reshard", staged / "base", tmp_path / "base_pp1", "--pp", 1, "--format", "megatron")
    megatron_bridge_peft.run(
        reference, "--tp", 2, "--pp", 1, "--mode", "seeded", "--base", tmp_path / "base_pp1"
    )
    cli("merge-lora", staged / "base", staged, tmp_path / "merged", "--lora-alpha", ALPHA)
    truth = torch.load(reference / "logits.pt")
    logits = _logits(tmp_path / "merged", truth["input_ids"])
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-5)


def test_each_experts_adapter_lands_on_that_expert(tmp_path: Path, cli) -> None:
    """A Qwen3-MoE-like model at EP 2 (SequentialMLP): Megatron-Bridge gives every expert's
    linear_fc1 / linear_fc2 an adapter of its own, saved in its EP rank's file under its local
    number; merged, transformers' logits equal megatron-core's forward with them on."""
    out = tmp_path / "moe"
    megatron_bridge_peft.run(out, "--tp", 1, "--ep", 2, "--mode", "train")
    cli("merge-lora", out / "base", out, tmp_path / "merged", "--lora-alpha", ALPHA)
    merged = _tensors(tmp_path / "merged")
    experts = [n for n in merged if ".mlp.experts." in n]
    assert len(experts) == 2 * 4 * 3  # 2 layers x 4 experts x gate / up / down
    truth = torch.load(out / "logits.pt")
    logits = _logits(tmp_path / "merged", truth["input_ids"])
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-5)
    cli("consolidate", out / "base", tmp_path / "base", "--format", "hf")
    base = _tensors(tmp_path / "base")
    changed = [n for n in experts if not torch.equal(merged[n], base[n])]
    assert len(changed) == len(experts)  # every expert got its own (trained) update


def test_what_the_adapter_does_not_say_is_refused_by_name(
    trained: Path, tmp_path: Path, cli
) -> None:
    base = trained / "base"
    result = cli("merge-lora", base, trained, tmp_path / "o1", code=2)
    assert "--lora-alpha" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = cli("inspect", trained, code=3)  # the adapter alone is no model
    assert "merge-lora BASE" in result.stderr

    other = tmp_path / "vpp"
    shutil.copytree(trained, other, ignore=shutil.ignore_patterns("base"))
    saved = json.loads((other / "transformer_config.json").read_text())
    saved["virtual_pipeline_model_parallel_size"] = 2
    saved["pipeline_model_parallel_size"] = 2
    (other / "transformer_config.json").write_text(json.dumps(saved))
    result = cli("merge-lora", base, other, tmp_path / "o2", "--lora-alpha", ALPHA, code=3)
    assert "first model chunk" in result.stderr
    saved.update(virtual_pipeline_model_parallel_size=None, account_for_loss_in_pipeline_split=True)
    (other / "transformer_config.json").write_text(json.dumps(saved))
    result = cli("merge-lora", base, other, tmp_path / "o2", "--lora-alpha", ALPHA, code=3)
    assert "account_for_loss_in_pipeline_split" in result.stderr

    dora = tmp_path / "dora"
    shutil.copytree(trained, dora, ignore=shutil.ignore_patterns("base"))
    rank_file = dora / "adapter_checkpoint" / "mp_rank_00_adapter.pt"
    state = torch.load(rank_file)
    name = "decoder.layers.0.self_attention.linear_qkv.adapter.weight_magnitude"
    state["adapter_state_dict"][name] = torch.ones(64)
    torch.save(state, rank_file)
    result = cli("merge-lora", base, dora, tmp_path / "o3", "--lora-alpha", ALPHA, code=3)
    assert name in result.stderr

    (dora / "adapter_checkpoint" / "mp_rank_01_adapter.pt").unlink()
    (dora / "adapter_checkpoint" / "mp_rank_00_adapter.pt").unlink()
    shutil.copy(
        trained / "adapter_checkpoint" / "mp_rank_00_adapter.pt", dora / "adapter_checkpoint"
    )
    result = cli("merge-lora", base, dora, tmp_path / "o4", "--lora-alpha", ALPHA, code=3)
    assert "missing" in result.stderr
    assert not (tmp_path / "o4").exists()
