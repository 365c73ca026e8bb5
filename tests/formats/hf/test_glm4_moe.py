"""GLM-4.5's HF family (issue 54): ``Glm4MoeForCausalLM`` models built by transformers (q/k/v
biases, per-head q/k norms, RoPE over half of each head, a dense first layer, then routed
experts with a shared one and DeepSeek's sigmoid router) go to Megatron layouts and back bit
for bit with the original's logits, with the MTP layer GLM-4.5's releases keep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.formats.hf.routed_models import randomised_and_saved, safetensors_of, with_mtp_layer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

IDS = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(6))


def _make(root: Path) -> torch.nn.Module:
    config = transformers.Glm4MoeConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_shared_experts=1,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(13)
    return randomised_and_saved(transformers.Glm4MoeForCausalLM(config), root)


def test_glm4_moe_goes_to_megatron_and_back_bit_exactly(tmp_path: Path, cli) -> None:
    src = tmp_path / "hf"
    model = _make(src)
    theirs = with_mtp_layer(transformers.Glm4MoeForCausalLM, model.config, src, layers=4)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2", "--ep", "2", "--dp", "2")
    spec = cli.json("inspect", megatron)["spec"]
    assert (spec["rotary_percent"], spec["add_qkv_bias"], spec["qk_layernorm"]) == (0.5, True, True)
    assert spec["dense_layers"] == [0] and spec["moe_router_score_function"] == "sigmoid"
    assert spec["mtp_num_layers"] == 1
    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["Glm4MoeForCausalLM"]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert config["num_nextn_predict_layers"] == 1
    mine = safetensors_of(back)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
