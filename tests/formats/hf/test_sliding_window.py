"""Sliding-window attention (issue 56): HF models built by transformers with windows go to
Megatron (TP2 PP2, and EP2 for the MoE families) and back bit for bit, their windows kept; the
round-tripped model's logits equal the original's on a sequence longer than the window (so a
window lost or misplaced on any layer changes them). What a family cannot say is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.formats.hf.models import logits, saved_model, tensors

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 300
WINDOW = 3
IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(9))
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}

# name -> (config class, class name, config fields, (window, full-attention layers) expected)
CASES = {
    "mistral": (transformers.MistralConfig, "MistralForCausalLM", {"sliding_window": WINDOW}, []),
    "qwen2_by_depth": (
        transformers.Qwen2Config,
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
        [0, 1],
    ),
    "qwen3_layer_types": (
        transformers.Qwen3Config,
        "Qwen3ForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "head_dim": 16,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
        },
        [1, 3],
    ),
    "mixtral": (
        transformers.MixtralConfig,
        "MixtralForCausalLM",
        {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
        [],
    ),
    "qwen2_moe_default_pattern": (
        transformers.Qwen2MoeConfig,
        "Qwen2MoeForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 3,
            "num_experts": 4,
            "shared_expert_intermediate_size": 48,
            **MOE,
        },
        [1, 3],
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        "Qwen3MoeForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "num_experts": 4, **MOE},
        [],
    ),
}


def _make(case: str, root: Path, **extra: object) -> torch.nn.Module:
    config_cls, _, fields, _ = CASES[case]
    config = config_cls(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        **{**fields, **extra},
    )
    return saved_model(config, root, seed=5)


@pytest.mark.parametrize("case", list(CASES))
def test_a_windowed_family_goes_to_megatron_and_back_with_its_windows(
    case: str, tmp_path: Path, cli
) -> None:
    src = tmp_path / "hf"
    model = _make(case, src)
    # The window matters on these inputs: the same weights without it give other logits.
    plain = transformers.AutoConfig.from_pretrained(src)
    plain.sliding_window = 1 << 20  # wider than the inputs: no window at all
    unwindowed = transformers.AutoModelForCausalLM.from_config(plain, dtype=torch.float32)
    unwindowed.load_state_dict(model.state_dict())
    assert not torch.allclose(logits(unwindowed.eval(), IDS), logits(model, IDS), atol=1e-3)

    megatron = tmp_path / "megatron"
    experts = ["--ep", "2", "--dp", "2"]
    moe = case in ("mixtral", "qwen2_moe_default_pattern", "qwen3_moe")
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2", *(experts if moe else []))
    spec = cli.json("inspect", megatron)["spec"]
    assert spec["window_size"] == [WINDOW - 1, 0]
    assert spec["full_attention_layers"] == CASES[case][3]

    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    mine, theirs = tensors(back), tensors(src)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    assert type(loaded).__name__ == CASES[case][1]
    assert torch.equal(logits(loaded.eval(), IDS), logits(model, IDS))


def test_a_window_of_some_layers_of_a_plain_model_has_no_hf_class(tmp_path: Path, cli) -> None:
    """Megatron may window some layers of a Llama-shaped model: Mistral windows all of them,
    Llama none, so the conversion to HF is refused, naming both; Megatron keeps it."""
    src = tmp_path / "hf"
    _make("mistral", src)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2")
    for path in megatron.rglob("model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        state["args"].window_attn_skip_freq = 2
        state["args"].ckptctl_hf_family = None
        torch.save(state, path)
    assert cli.json("inspect", megatron)["spec"]["full_attention_layers"] == [1, 3]
    result = cli("consolidate", megatron, tmp_path / "out", "--format", "hf", code=2)
    assert "MistralForCausalLM windows every layer; layers [1, 3]" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("case", "edit", "named"),
    [
        (
            "qwen3_layer_types",
            {"use_sliding_window": False},
            "layer_types names sliding_attention layers but sliding_window is 3 "
            "(use_sliding_window=False)",
        ),
        ("qwen3_layer_types", {"layer_types": ["chunked_attention"] * 4}, "layer_types="),
        ("mistral", {"sliding_window": -4}, "sliding_window=-4: not a window of tokens"),
    ],
)
def test_windows_transformers_would_not_read_as_said_are_refused(
    case: str, edit: dict[str, object], named: str, tmp_path: Path, cli
) -> None:
    src = tmp_path / "hf"
    _make(case, src)
    config = json.loads((src / "config.json").read_text())
    config.update(edit)
    (src / "config.json").write_text(json.dumps(config))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=2)
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
