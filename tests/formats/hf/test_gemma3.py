"""Gemma 3 (issue 56): ``Gemma3ForCausalLM`` models transformers builds go to Megatron (TP2 PP2,
legacy and ``torch_dist``) and back bit for bit, with transformers' logits unchanged on a
sequence longer than the window: four norms per layer scaling by ``1 + weight``, the scaled
embedding, ``query_pre_attn_scalar``, local and global layers with RoPE bases of their own and
linear scaling on the global ones. Configs as the hub holds them (``rope_theta``,
``rope_local_base_freq``, ``sliding_window_pattern``) are read as transformers reads them; what
Megatron cannot say is refused by name.

The Megatron side is judged by Megatron-Bridge's own Gemma 3 layers on megatron-core
(``tests/oracles/megatron_bridge_gemma3.py``, its CPU shims named there): its checkpoint
consolidates to HF with transformers' logits equal to its forward, and a TP1 PP2 reshard loads
into it (strict, in its order) with the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptctl.errors import LayoutError
from ckptctl.model.hf_families import choose_family
from ckptctl.model.layout import Activation, ModelSpec
from tests.formats.hf.models import logits, saved_model, tensors

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 300
IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
SMALL = dict(
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    sliding_window=3,
)


def _make(root: Path, **extra: object) -> torch.nn.Module:
    config = transformers.Gemma3TextConfig(**{**SMALL, **extra})
    return saved_model(config, root, seed=1)


def _same_model(back: Path, src: Path, model: torch.nn.Module) -> torch.nn.Module:
    mine, theirs = tensors(back), tensors(src)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Gemma3ForCausalLM"
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    assert torch.equal(logits(loaded, IDS), logits(model, IDS))
    return loaded


@pytest.mark.parametrize("form", ["megatron", "torch_dist"])
def test_gemma3_goes_to_megatron_and_back_bit_exactly(tmp_path: Path, cli, form: str) -> None:
    src = tmp_path / "hf"
    model = _make(
        src,
        num_hidden_layers=6,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2", "--format", form)
    info = cli.json("inspect", megatron)
    assert info["hf"]["architecture"] == "Gemma3ForCausalLM"
    spec = info["spec"]
    assert spec["activation"] == "gelu_tanh" and spec["scaled_embedding"]
    assert spec["layernorm_zero_centered_gamma"] and spec["post_sublayer_norms"]
    assert spec["softmax_scale"] == 24**-0.5
    assert spec["local_rotary_base"] == 1e4 and spec["rotary_base"] == 1e6
    assert spec["rope_scaling"]["kind"] == "linear" and spec["rope_scaling"]["factor"] == 8.0
    assert spec["window_size"] == [2, 0] and spec["full_attention_layers"] == [2, 5]

    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    _same_model(back, src, model)
    assert cli.json("verify", back, "--against", megatron)["ok"]


def test_a_hub_style_config_reads_as_transformers_reads_it(tmp_path: Path, cli) -> None:
    """gemma-3-1b's config.json spells the RoPE bases and the pattern the old way; untied here."""
    src = tmp_path / "hf"
    model = _make(src, num_hidden_layers=4, tie_word_embeddings=False)
    config = json.loads((src / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        config.pop(key, None)
    config |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 2}
    config |= {"rope_scaling": None, "hidden_activation": "gelu_pytorch_tanh"}
    (src / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2

    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2")
    assert cli.json("inspect", megatron)["spec"]["full_attention_layers"] == [1, 3]
    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    _same_model(back, src, model)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            },
            "rope_parameters.sliding_attention",
        ),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "rope_parameters.full_attention",
        ),
    ],
)
def test_what_megatron_cannot_say_is_refused_by_name(
    tmp_path: Path, cli, extra: dict[str, object], named: str
) -> None:
    src = tmp_path / "hf"
    _make(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **extra}))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=2)
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_gemmas_features_are_refused_by_the_other_families() -> None:
    base = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=48,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        vocab_size=VOCAB,
    )
    for field, value in (
        ("layernorm_zero_centered_gamma", True),
        ("scaled_embedding", True),
        ("softmax_scale", 0.2),
        ("activation", Activation.GELU_TANH),
    ):
        spec = ModelSpec(**base, **{field: value})
        with pytest.raises(LayoutError, match=field.replace("activation", "gelu_tanh")):
            choose_family(spec)
    # a Gemma 3 model without its features (here: no scaled embedding) is no Gemma 3
    gemma = dict(
        activation=Activation.GELU_TANH,
        layernorm_zero_centered_gamma=True,
        post_sublayer_norms=True,
        qk_layernorm=True,
        tie_embeddings=True,
    )
    with pytest.raises(LayoutError, match="scales its embedding"):
        choose_family(ModelSpec(**base, **gemma))
    with pytest.raises(ValueError, match="local_rotary_base needs windowed layers"):
        ModelSpec(**base, **gemma, local_rotary_base=1e4)  # without windowed layers
