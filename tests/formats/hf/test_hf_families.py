"""HF families beyond Llama (issue 14): models made by transformers go to Megatron and back bit
for bit, in their own class; a ``config.json`` field ckptctl cannot honour is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

IDS = torch.randint(0, 1100, (2, 13), generator=torch.Generator().manual_seed(4))
FAMILIES = {
    "llama": (transformers.LlamaConfig, "LlamaForCausalLM", {"attention_bias": False}),
    "mistral": (transformers.MistralConfig, "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM", {}),
    "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM", {"head_dim": 16}),
}


def _make(family: str, root: Path, **extra: object) -> torch.nn.Module:
    config_cls, _, defaults = FAMILIES[family]
    config = config_cls(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1100,
        max_position_embeddings=256,
        **{**defaults, **extra},
    )
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Biases and norms start at zero and one: random values catch any misplaced one.
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(root)
    return model.eval()


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(path))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_family_goes_to_megatron_and_back_bit_exactly(family: str, tmp_path: Path, cli) -> None:
    src = tmp_path / "hf"
    model = _make(family, src)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2")
    info = cli.json("inspect", megatron)
    assert info["hf"]["architecture"] == FAMILIES[family][1]
    assert info["spec"]["qk_layernorm"] is (family == "qwen3")
    assert info["spec"]["add_qkv_bias"] is (family == "qwen2")

    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[family][1]]
    mine, theirs = _tensors(back), _tensors(src)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    assert type(loaded).__name__ == FAMILIES[family][1]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize(
    ("family", "edit", "named"),
    [
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor: unknown to ckptctl"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}},
            "rope_parameters.rope_type='dynamic'",
        ),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("mistral", {"layer_types": ["full_attention"] * 4}, "layer_types: unknown to ckptctl"),
        ("qwen3", {"attention_bias": True}, "attention_bias=true"),
        ("qwen3", {"some_new_feature": 1}, "some_new_feature: unknown to ckptctl"),
    ],
)
def test_config_fields_ckptctl_cannot_honour_are_refused_by_name(
    family: str, edit: dict[str, object], named: str, tmp_path: Path, cli
) -> None:
    src = tmp_path / "hf"
    _make(family, src)
    config = json.loads((src / "config.json").read_text())
    config.update(edit)
    (src / "config.json").write_text(json.dumps(config))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=2)
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
