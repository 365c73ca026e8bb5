"""RoPE scaling (issue 56's YaRN, and Llama 3.1's llama3 scaling): HF models built by
transformers with a scaled RoPE go to Megatron (TP2 PP2) and back bit for bit, the scaling
kept in Megatron-LM's own argument names, and the round-tripped model's logits equal the
original's (the scaling changes them: checked). What Megatron cannot say is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.formats.hf.models import logits, saved_model, tensors

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

IDS = torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(2))
LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# name -> (config class, rope parameters, max positions, Megatron args expected)
CASES = {
    "llama31": (
        transformers.LlamaConfig,
        {**LLAMA31, "rope_theta": 500000.0},
        131072,
        {"use_rope_scaling": True, "rope_scaling_factor": 8.0},
    ),
    "qwen3_yarn": (
        transformers.Qwen3Config,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "rope_theta": 1e4,
        },
        32,
        {"position_embedding_type": "yarn", "rotary_scaling_factor": 4.0},
    ),
    "mistral_yarn_untruncated": (
        transformers.MistralConfig,
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 0.7,
            "mscale_all_dim": 0.5,
            "truncate": False,
            "rope_theta": 1e4,
        },
        16,
        {"yarn_correction_range_round_to_int": False, "mscale": 0.7, "mscale_all_dim": 0.5},
    ),
}


def _make(case: str, root: Path, rope: dict[str, object] | None = None) -> torch.nn.Module:
    config_cls, parameters, positions, _ = CASES[case]
    config = config_cls(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        max_position_embeddings=positions,
        rope_parameters=rope or parameters,
        **({"sliding_window": None} if case.startswith("mistral") else {}),
    )
    return saved_model(config, root, seed=6)


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_rope_goes_to_megatron_and_back(case: str, tmp_path: Path, cli) -> None:
    src = tmp_path / "hf"
    model = _make(case, src)
    plain = _make(
        case,
        tmp_path / "plain",
        {"rope_type": "default", "rope_theta": CASES[case][1]["rope_theta"]},
    )
    assert not torch.allclose(
        logits(plain, IDS), logits(model, IDS), atol=1e-5
    )  # the scaling shows

    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2")
    rank = next(megatron.rglob("model_optim_rng.pt"))
    args = vars(torch.load(rank, weights_only=False)["args"])
    assert {k: args[k] for k in CASES[case][3]} == CASES[case][3]
    assert (
        cli.json("inspect", megatron)["spec"]["rope_scaling"]["factor"] == CASES[case][1]["factor"]
    )

    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    mine, theirs = tensors(back), tensors(src)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert loaded.config.rope_parameters == model.config.rope_parameters
    assert torch.equal(logits(loaded, IDS), logits(model, IDS))


def test_llama3_numbers_megatron_core_fixes_otherwise_are_refused_for_megatron(
    tmp_path: Path, cli
) -> None:
    src = tmp_path / "hf"
    _make("llama31", src, {**LLAMA31, "low_freq_factor": 2.0, "rope_theta": 5e5})
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=2)
    assert "megatron-core fixes" in result.stderr and "low_freq_factor" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    # HF to HF keeps it
    cli("consolidate", src, tmp_path / "hf2", "--format", "hf")
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["rope_parameters"]["low_freq_factor"] == 2.0


@pytest.mark.parametrize(
    ("rope", "named"),
    [
        ({"rope_type": "longrope", "rope_theta": 1e4}, "rope_type='longrope'"),
        (
            {**LLAMA31, "rope_theta": 5e5, "attention_factor": 1.5},
            "rope_parameters.attention_factor=1.5: unknown to ckptctl",
        ),
        ({"rope_type": ["yarn"], "rope_theta": 1e4}, "rope_parameters.rope_type=['yarn']"),
    ],
)
def test_rope_scalings_not_read_are_refused_by_name(
    rope: dict[str, object], named: str, tmp_path: Path, cli
) -> None:
    src = tmp_path / "hf"
    _make("llama31", src)
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"] = rope
    (src / "config.json").write_text(json.dumps(config))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=2)
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
