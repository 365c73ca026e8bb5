"""Qwen3.5 (issue 56): ``Qwen3_5ForCausalLM`` models transformers builds go to Megatron (TP2 PP2,
legacy and ``torch_dist``) and back bit for bit, with transformers' logits unchanged: gated
delta net layers (their fused ``in_proj`` cut into HF's four projections, ``conv1d``,
``A_log``, ``dt_bias``, the gated norm stored as one plus Megatron's zero-centred weight),
gated attention (each head's query and gate in ``q_proj``), partial RoPE, norms scaling by
``1 + weight``. What Megatron cannot say is refused by name; a shift that would round is
refused, never rounded.

The Megatron side is judged by megatron-core's own ``GatedDeltaNet`` in
``tests/formats/megatron/test_oracle_gdn.py`` (its checkpoint becomes this class with
megatron-core's logits).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.formats.hf.models import logits, saved_model, tensors

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 300
IDS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
SMALL = dict(
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _make(root: Path, dtype: torch.dtype = torch.float32, **extra: object) -> torch.nn.Module:
    """The model, its gated norms near one as a trained model's are (``1 + N(0, 0.1)``: HF
    stores one plus Megatron's zero-centred weight)."""
    config = transformers.Qwen3_5TextConfig(**{**SMALL, **extra})
    model = saved_model(config, root, seed=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
    model = model.to(dtype)
    model.save_pretrained(root)
    return model


def _same_model(back: Path, src: Path, model: torch.nn.Module) -> None:
    mine, theirs = tensors(back), tensors(src)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert tensor.dtype == mine[name].dtype and torch.equal(mine[name], tensor), name
    # both loaded alike (a model cast with .to() keeps its RoPE frequencies in its dtype)
    loaded, original = (
        transformers.AutoModelForCausalLM.from_pretrained(root, dtype=model.dtype).eval()
        for root in (back, src)
    )
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    for key in ("layer_types", "rope_parameters", "linear_num_value_heads", "head_dim"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    assert torch.equal(logits(loaded, IDS), logits(original, IDS))


@pytest.mark.parametrize(
    ("form", "dtype"), [("megatron", torch.float32), ("torch_dist", torch.bfloat16)]
)
def test_qwen35_goes_to_megatron_and_back_bit_exactly(
    tmp_path: Path, cli, form: str, dtype: torch.dtype
) -> None:
    src = tmp_path / "hf"
    kinds = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    model = _make(src, dtype, layer_types=kinds)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2", "--format", form)
    info = cli.json("inspect", megatron)
    assert info["hf"]["architecture"] == "Qwen3_5ForCausalLM"
    spec = info["spec"]
    assert spec["attention_output_gate"] and spec["layernorm_zero_centered_gamma"]
    assert spec["rotary_percent"] == 0.25
    assert spec["linear_attention"]["attention_layers"] == [1, 3]
    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    _same_model(back, src, model)
    # Megatron holds the gated norm zero-centred: HF's weight minus one
    hf_norm = tensors(src)["model.layers.0.linear_attn.norm.weight"]
    mine = _megatron_tensor(megatron, "decoder.layers.0.self_attention.out_norm.weight")
    assert mine is None or torch.equal(mine, hf_norm - 1)


def _megatron_tensor(root: Path, name: str) -> torch.Tensor | None:
    """``name`` of a legacy checkpoint's first rank file (``None`` for ``torch_dist``)."""
    files = sorted(root.rglob("mp_rank_00_000/model_optim_rng.pt"))
    if not files:
        return None
    return torch.load(files[0], weights_only=False)["model"][name]


def test_hub_defaults_are_read_as_transformers_reads_them(tmp_path: Path, cli) -> None:
    """No ``layer_types`` (every 4th layer attends fully: ``full_attention_interval``), the
    rotated share at the top level as older configs hold it."""
    src = tmp_path / "hf"
    model = _make(src, num_hidden_layers=8)
    config = json.loads((src / "config.json").read_text())
    del config["layer_types"]
    config["rope_parameters"].pop("partial_rotary_factor")
    config["partial_rotary_factor"] = 0.25
    (src / "config.json").write_text(json.dumps(config))
    spec = cli.json("inspect", src)["spec"]
    assert spec["linear_attention"]["attention_layers"] == [3, 7]
    assert spec["rotary_percent"] == 0.25
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    cli("reshard", src, megatron, "--tp", "2", "--format", "megatron")
    cli("consolidate", megatron, back, "--format", "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert torch.equal(logits(loaded, IDS), logits(model, IDS))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "ckptctl reads plain RoPE (rope_theta, partial_rotary_factor)",
        ),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"attn_output_gate": False}, "attn_output_gate=False"),
        ({"output_gate_type": "sigmoid"}, "output_gate_type='sigmoid'"),
        ({"mtp_num_hidden_layers": -1}, "mtp_num_hidden_layers=-1 is not a layer count"),
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types=['linear_attention'"),
    ],
)
def test_what_megatron_cannot_say_is_refused_by_name(
    tmp_path: Path, cli, change: dict[str, object], message: str
) -> None:
    src = tmp_path / "hf"
    _make(src)
    config = json.loads((src / "config.json").read_text()) | change
    (src / "config.json").write_text(json.dumps(config))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", "--format", "megatron", code=2)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_what_the_releases_configs_add_is_read_past_saying_so(tmp_path: Path, cli) -> None:
    """The releases' text configs carry fields transformers' class does not read: gated
    attention and the SiLU gate it always applies, the recurrent state's dtype of inference
    engines, one MTP layer (whose weights transformers drops when it saves). Read past, the MTP
    layer said to be left out, and the model goes to Megatron and back unchanged."""
    src = tmp_path / "hf"
    model = _make(src)
    config = json.loads((src / "config.json").read_text())
    config |= {
        "attn_output_gate": True,
        "output_gate_type": "swish",
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "use_sliding_window": False,  # Qwen2's window fields, as Qwen3-Next's releases keep
        "sliding_window": None,
    }
    (src / "config.json").write_text(json.dumps(config))
    info = cli.json("inspect", src)
    assert any("1 multi-token prediction layer(s)" in w for w in info["warnings"]), info
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2", "--format", "megatron")
    cli("consolidate", megatron, back, "--format", "hf")
    _same_model(back, src, model)


def test_a_shift_that_would_round_is_refused_and_a_wider_dtype_holds_it(
    tmp_path: Path, cli
) -> None:
    """A bf16 Megatron model whose zero-centred gated norm holds 2**-10: one plus it is no
    bf16 number. HF would round it: refused, naming the tensor; ``--dtype fp32`` holds it."""
    src = tmp_path / "hf"
    _make(src, torch.bfloat16)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--format", "megatron")
    for path in megatron.rglob("model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        state["model"]["decoder.layers.0.self_attention.out_norm.weight"][0] = 2.0**-10
        torch.save(state, path)
    result = cli("consolidate", megatron, tmp_path / "out", "--format", "hf", code=3)
    assert "model.layers.0.linear_attn.norm.weight: element 0 (0.0009765625) plus 1" in (
        result.stderr
    )
    assert "pass --dtype fp32" in result.stderr and "Traceback" not in result.stderr
    assert "--allow-rounding" in result.stderr
    wide = tmp_path / "wide"
    cli("consolidate", megatron, wide, "--format", "hf", "--dtype", "fp32")
    norm = tensors(wide)["model.layers.0.linear_attn.norm.weight"]
    assert norm.dtype == torch.float32 and norm[0].item() == 1 + 2.0**-10


def test_a_shift_rounded_when_asked_is_torchs_sum_and_verify_holds_it_to_its_error(
    tmp_path: Path, cli
) -> None:
    """A bf16 Megatron model trained as Megatron trains it: its zero-centred gated norms small,
    so one plus them is rarely a bf16 number. ``--allow-rounding`` writes torch's own bf16
    ``w + 1`` (what Megatron-Bridge computes), every other tensor bit for bit; the manifest
    records each norm's largest error, which ``verify --against`` holds the output to, and a
    norm moved further fails it."""
    src = tmp_path / "hf"
    _make(src, torch.bfloat16)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--format", "megatron")
    norms: dict[str, torch.Tensor] = {}
    for path in sorted(megatron.rglob("model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)
        for key, tensor in state["model"].items():
            if key.endswith("self_attention.out_norm.weight"):
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=torch.Generator()))
                norms[key] = tensor.clone()
        torch.save(state, path)
    assert norms
    out = tmp_path / "out"
    result = cli("consolidate", megatron, out, "--format", "hf", "--allow-rounding")
    assert "--allow-rounding" in result.stderr + result.stdout
    written, before = tensors(out), tensors(src)
    for name, tensor in before.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        key = f"decoder.layers.{layer}.self_attention.out_norm.weight"
        if name.endswith("linear_attn.norm.weight"):
            assert written[name].dtype == torch.bfloat16
            assert torch.equal(written[name], norms[key] + 1), name  # torch's bf16 sum
        else:
            assert torch.equal(written[name], tensor), name
    manifest_path = out / "ckptctl.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    errors = manifest["quantized_max_abs_error"]
    assert set(errors) == set(norms)  # by canonical name: Megatron's
    assert all(0 < error <= 2.0**-8 for error in errors.values()), errors  # half a bf16 step
    assert cli.json("verify", out, "--against", megatron)["ok"]
    # the record claiming less: the rounded norms no longer pass
    manifest["quantized_max_abs_error"] = {name: 0.0 for name in errors}
    manifest_path.write_text(json.dumps(manifest))
    failed = json.loads(cli("verify", out, "--against", megatron, "--json", code=1).stdout)
    assert not failed["ok"]
    # a target that stores nothing shifted: the flag would change nothing, refused
    again = cli("consolidate", megatron, tmp_path / "m1", "--format", "megatron",
                "--allow-rounding", code=2)  # fmt: skip
    assert "--allow-rounding" in again.stderr and not (tmp_path / "m1").exists()


def test_an_hf_gated_norm_megatron_cannot_hold_is_refused(tmp_path: Path, cli) -> None:
    """An fp32 weight of 0.1 minus one is no fp32 number: refused, never rounded."""
    src = tmp_path / "hf"
    _make(src)
    weights = tensors(src)
    weights["model.layers.0.linear_attn.norm.weight"][1] = 0.1
    safetensors_torch.save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", "--format", "megatron", code=3)
    assert "model.layers.0.linear_attn.norm.weight: element 1 (0.10000000149011612) minus 1" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_an_hf_gated_norm_rounded_when_asked_is_torchs_difference(tmp_path: Path, cli) -> None:
    """A bf16 release's gated norm may hold weights below 0.5, whose ``w - 1`` is no bf16
    number: refused, naming ``--allow-rounding``; with it, Megatron's ``out_norm`` is torch's
    rounded bf16 difference (what Megatron-Bridge computes), every other tensor exact, each
    rounded norm's largest error in the output's manifest."""
    src = tmp_path / "hf"
    _make(src, torch.bfloat16)
    weights = tensors(src)
    name = "model.layers.0.linear_attn.norm.weight"
    weights[name][:3] = torch.tensor([0.3, 0.4140625, 0.2], dtype=torch.bfloat16)
    safetensors_torch.save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    refused = cli("reshard", src, tmp_path / "refused", "--tp", "2", "--format", "megatron",
                  code=3)  # fmt: skip
    assert "--allow-rounding" in refused.stderr  # (found as it reads: left marked incomplete)
    out = tmp_path / "megatron"
    cli("reshard", src, out, "--tp", "2", "--format", "megatron", "--allow-rounding")
    key = "decoder.layers.0.self_attention.out_norm.weight"
    for path in sorted(out.rglob("model_optim_rng.pt")):  # replicated over TP: each rank's
        held = torch.load(path, weights_only=False)["model"][key]
        assert torch.equal(held, weights[name] - 1)  # torch's bf16 difference, rounded once
    manifest = json.loads((out / "ckptctl.manifest.json").read_text())
    errors = manifest["quantized_max_abs_error"]
    assert set(errors) == {key} and 0 < errors[key] <= 2.0**-9, errors
    # the other layers' norms (all above 0.5) came exactly: no error recorded for them
    back = tmp_path / "back"
    cli("consolidate", out, back, "--format", "hf")
    moved = tensors(back)
    for other, tensor in weights.items():
        if other != name:
            assert torch.equal(moved[other], tensor), other
    assert torch.equal(moved[name][3:], weights[name][3:])
    assert cli.json("verify", out, "--against", src, "--allow-rounding")["ok"]
    needless = cli("reshard", out, tmp_path / "again", "--tp", "1", "--allow-rounding", code=2)
    assert "--allow-rounding" in needless.stderr


NEXT = dict(
    SMALL,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=40,
    num_experts=4,
    num_experts_per_tok=2,
)


def saved_hybrid(config: object, root: Path, seed: int) -> torch.nn.Module:
    """``saved_model`` with the gated norms near one (``1 + N(0, 0.1)``), as a trained model's
    are (HF stores one plus Megatron's zero-centred weight)."""
    model = saved_model(config, root, seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
    model.save_pretrained(root)
    return model


def _loaded_anew(root: Path) -> torch.nn.Module:
    """``root``'s model with its parameters copied out of the mapped file: CPU kernels round
    by the alignment of their operands, which differs with a tensor's place in the file."""
    model = transformers.AutoModelForCausalLM.from_pretrained(root).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return model


@pytest.mark.parametrize(
    ("family", "form"),
    [("Qwen3NextForCausalLM", "megatron"), ("Qwen3NextForCausalLM", "torch_dist"),
     ("Qwen3_5MoeForCausalLM", "torch_dist")],
)  # fmt: skip
def test_the_routed_hybrids_go_to_megatron_with_experts_and_back_bit_exactly(
    tmp_path: Path, cli, family: str, form: str
) -> None:
    """Qwen3-Next (its fused projections grouped by key head: ``in_proj_qkvz``,
    ``in_proj_ba``) and Qwen3.5-MoE (split as Qwen3.5's; no ``intermediate_size`` in its
    config): the hybrid with routed experts and a gated shared expert in every layer."""
    src = tmp_path / "hf"
    if family == "Qwen3NextForCausalLM":
        config = transformers.Qwen3NextConfig(**NEXT)
    else:
        fields = {k: v for k, v in NEXT.items() if k != "intermediate_size"}
        config = transformers.Qwen3_5MoeTextConfig(**fields)
    saved_hybrid(config, src, seed=2)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1",
        "--format", form)  # fmt: skip
    info = cli.json("inspect", megatron)
    assert info["hf"]["architecture"] == family
    spec = info["spec"]
    assert spec["num_experts"] == 4 and spec["moe_shared_expert_gate"]
    assert spec["linear_attention"]["attention_layers"] == [3]
    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    mine, theirs = tensors(back), tensors(src)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    assert torch.equal(logits(_loaded_anew(back), IDS), logits(_loaded_anew(src), IDS))
    written = json.loads((back / "config.json").read_text())
    assert written["architectures"] == [family]
    assert ("intermediate_size" in written) == (family == "Qwen3NextForCausalLM")
