"""DeepSeek-V3's HF family (issue 54): models built by transformers' ``DeepseekV3ForCausalLM``
(multi-latent attention; dense layers first, routed ones with a shared expert and DeepSeek's
sigmoid router after) go to Megatron layouts and back bit for bit with the original's logits;
what ckptctl does not carry yet is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.formats.hf.routed_models import randomised_and_saved, safetensors_of

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

IDS = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(5))


def _make(root: Path, *, moe: bool, dense_first: int = 1, **extra: object) -> torch.nn.Module:
    sizes: dict[str, object] = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=dense_first if moe else 4,
        num_nextn_predict_layers=0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config = transformers.DeepseekV3Config(**(sizes | extra))
    torch.manual_seed(12)
    return randomised_and_saved(transformers.DeepseekV3ForCausalLM(config), root)


@pytest.mark.parametrize(
    ("moe", "dense_first", "layout"),
    [
        (False, 4, ("--tp", "2", "--pp", "2")),
        (True, 0, ("--tp", "2", "--ep", "2", "--dp", "2")),
        (True, 1, ("--tp", "2", "--pp", "2", "--ep", "2", "--dp", "2")),
    ],
    ids=["dense", "moe", "dense-first-moe"],
)
def test_deepseek_v3_goes_to_megatron_and_back_bit_exactly(
    moe: bool, dense_first: int, layout: tuple[str, ...], tmp_path: Path, cli
) -> None:
    """Every layer dense; every layer routed; and DeepSeek-V3's own shape, dense layers first
    (here one, on the first pipeline stage with a routed one)."""
    src = tmp_path / "hf"
    model = _make(src, moe=moe, dense_first=dense_first)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, *layout)
    info = cli.json("inspect", megatron)
    assert info["spec"]["mla"]["q_lora_rank"] == 32 and info["spec"]["mla"]["v_head_dim"] == 16
    assert info["spec"]["num_experts"] == (8 if moe else None)
    assert info["spec"]["dense_layers"] == list(range(dense_first if moe else 0))
    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    mine, theirs = safetensors_of(back), safetensors_of(src)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


def test_yarn_and_uncompressed_queries_are_carried(tmp_path: Path, cli) -> None:
    """YaRN's settings (DeepSeek-V3's long context) and queries without compression
    (``q_lora_rank`` unset: one ``q_proj``) survive HF -> Megatron -> HF."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    src = tmp_path / "hf"
    model = _make(
        src, moe=False, q_lora_rank=None, rope_parameters=yarn, max_position_embeddings=16384
    )
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    cli("reshard", src, megatron, "--tp", "2")
    cli("consolidate", megatron, back, "--format", "hf")
    config = json.loads((back / "config.json").read_text())
    assert config["q_lora_rank"] is None
    assert {k: config["rope_parameters"][k] for k in yarn} == yarn
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
        ({"rope_interleave": False}, "rope_interleave=False"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false"),
        ({"num_experts_per_tok": 1}, "norm_topk_prob=true with 1 expert(s) per token"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        # Megatron-LM's MLA config takes YaRN's original context from no argument
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
            "original_max_position_embeddings=32",
        ),
    ],
)
def test_what_ckptctl_does_not_carry_yet_is_refused_by_name(
    edit: dict[str, object], named: str, tmp_path: Path, cli
) -> None:
    src = tmp_path / "hf"
    _make(src, moe=True)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **edit}))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=2)
    assert named in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
