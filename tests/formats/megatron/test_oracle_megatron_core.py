"""megatron-core as the writer: its own GPTModel saves TP=2 legacy shards, ckptctl consolidates
them to HF, and transformers' logits must match megatron-core's own TP forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.oracle_runner import run_oracle

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is the oracle here")
transformers = pytest.importorskip("transformers")

WRITER = "megatron_core_legacy_writer.py"
pytestmark = pytest.mark.oracle


@pytest.fixture(scope="module")
def megatron_core_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mcore") / "ckpt"
    run_oracle(WRITER, out, "--tp", 2, timeout=300)
    return out


def test_megatron_core_tp2_to_hf_logits_match(
    megatron_core_checkpoint: Path, tmp_path: Path, cli
) -> None:
    info = cli.json("inspect", megatron_core_checkpoint)
    assert info["layout"]["tp"] == 2 and info["spec"]["vocab_size"] == 1000
    out = tmp_path / "hf"
    cli("consolidate", megatron_core_checkpoint, out, "--format", "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = torch.load(megatron_core_checkpoint / "reference.pt", weights_only=True)
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    assert (logits - reference["logits"]).abs().max().item() < 1e-5


def test_megatron_core_local_spec_names_survive_consolidate_to_megatron(
    megatron_core_checkpoint: Path, tmp_path: Path, cli
) -> None:
    out = tmp_path / "full"
    cli("consolidate", megatron_core_checkpoint, out, "--format", "megatron")
    full = torch.load(out / "iter_0000001/mp_rank_00/model_optim_rng.pt", weights_only=False)
    shards = [
        torch.load(
            megatron_core_checkpoint / f"iter_0000001/mp_rank_0{r}/model_optim_rng.pt",
            weights_only=False,
        )["model"]
        for r in range(2)
    ]
    model = full["model"]
    assert "decoder.layers.0.input_layernorm.weight" in model
    assert full["args"].tensor_model_parallel_size == 1
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    assert torch.equal(model[name], torch.cat([s[name] for s in shards], dim=1))
    # SwiGLU: each shard is [gate_s; up_s]; the merged tensor is [gate; up].
    fc1 = [s["decoder.layers.0.mlp.linear_fc1.weight"] for s in shards]
    gate = torch.cat([f[: f.shape[0] // 2] for f in fc1])
    up = torch.cat([f[f.shape[0] // 2 :] for f in fc1])
    assert torch.equal(model["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate, up]))
