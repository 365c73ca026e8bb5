"""FP8 checkpoints as DeepSeek-V3 releases them (issue 54): linear weights in ``float8_e4m3fn``
with one float32 ``weight_scale_inv`` per block and ``quantization_config`` in config.json, made
here by quantising a transformers-built bf16 ``DeepseekV3ForCausalLM`` as DeepSeek's release
does (per-block absolute maximum over 448). ckptctl reads them dequantized: bitwise what
transformers' own ``Fp8Dequantize`` gives, or, where a dimension ends in a partial block (which
transformers refuses), what DeepSeek's ``weight_dequant`` computes; into HF bf16 and Megatron."""

from __future__ import annotations

import json
from math import ceil
from pathlib import Path

import pytest
import torch

from tests.formats.hf.routed_models import randomised_and_saved, safetensors_of

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")
pytest.importorskip("transformers.integrations.finegrained_fp8")


SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)
"""Sizes whose blocks (8 or 16 wide) tile the weights, but for one partial block at 16."""
RELEASE_SIZED = dict(
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_attention_heads=2,
    kv_lora_rank=128,
    q_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
)
"""Sizes whose linear weights span whole 128x128 blocks, but one: ``kv_a_proj_with_mqa`` has
192 rows, its last row of blocks partial."""


def _model(root: Path, sizes: dict[str, int] = SMALL, seed: int = 21) -> torch.nn.Module:
    """A bf16 DeepSeek-V3 made by transformers (a dense layer, then four routed experts)."""
    config = transformers.DeepseekV3Config(
        vocab_size=1000,
        num_hidden_layers=2,
        num_key_value_heads=sizes["num_attention_heads"],
        n_shared_experts=1,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        dtype="bfloat16",
        **sizes,
    )
    torch.manual_seed(seed)
    return randomised_and_saved(transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16), root)


def _quantised(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantisation: each block scaled so its largest magnitude is e4m3's
    largest (448); the scales kept as their inverse's inverse (``weight_scale_inv``)."""
    rows, columns = weight.shape
    grid = (ceil(rows / block[0]), ceil(columns / block[1]))
    w = weight.float()
    scales = torch.empty(grid)
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            cut = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale = w[cut].abs().max().clamp(min=1e-12) / 448.0
            scales[i, j] = scale
            q[cut] = (w[cut] / scale).to(torch.float8_e4m3fn)
    return q, scales


def _deepseek_dequant(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """DeepSeek's ``weight_dequant``, element by element: x * s in float32, then bf16."""
    rows, columns = q.shape
    s = scales.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return (q.float() * s).to(torch.bfloat16)


def _quantise_checkpoint(src: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Quantise ``src`` in place as released; the dequantized weights the judges expect."""
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensors = safetensors_of(src)
    expected: dict[str, torch.Tensor] = {}
    for name, weight in list(tensors.items()):
        linear = name.startswith("model.layers.") and weight.dim() == 2
        if not linear or name.endswith("mlp.gate.weight"):
            continue
        q, scales = _quantised(weight, block)
        tensors[name], tensors[name + "_scale_inv"] = q, scales
        whole_blocks = all(n % b == 0 for n, b in zip(weight.shape, block, strict=True))
        if whole_blocks:  # transformers' own dequantisation
            expected[name] = Fp8Dequantize(None)._dequantize_one(q, scales, torch.bfloat16)
            assert torch.equal(expected[name], _deepseek_dequant(q, scales, block))
        else:  # transformers refuses a partial block; DeepSeek's kernel takes it
            expected[name] = _deepseek_dequant(q, scales, block)
    for path in src.glob("*.safetensors"):
        path.unlink()
    (src / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    (src / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("block", [(8, 8), (16, 16)], ids=["whole-blocks", "partial-blocks"])
def test_a_block_fp8_release_is_read_dequantized_as_its_makers_do(
    block: tuple[int, int], tmp_path: Path, cli
) -> None:
    src = tmp_path / "fp8"
    _model(src)
    original = safetensors_of(src)
    expected = _quantise_checkpoint(src, block)
    assert len(expected) == 2 * 5 + 3 + 4 * 3 + 3  # attention, dense MLP, experts, shared
    # FP8 loses bits: reading the bytes as bf16 or skipping the scales cannot pass below
    assert not any(torch.equal(expected[name], original[name]) for name in expected)
    if block == (16, 16):  # kv_a_proj_with_mqa has 24 rows: its last blocks are partial
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in expected
    notes = cli.json("inspect", src)["notes"]
    assert any("FP8 (e4m3)" in note for note in notes), notes
    hf = tmp_path / "bf16"
    cli("consolidate", src, hf, "--format", "hf")
    config = json.loads((hf / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    mine = safetensors_of(hf)
    assert mine.keys() == original.keys()  # no scales: the weights are plain bf16 now
    for name, tensor in mine.items():
        assert tensor.dtype == original[name].dtype, name
        assert torch.equal(tensor, expected.get(name, original[name])), name
    # into Megatron (TP2 EP2, boxes cut through the blocks) and back: the same values
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    cli("reshard", src, megatron, "--tp", "2", "--ep", "2", "--dp", "2")
    cli("consolidate", megatron, back, "--format", "hf")
    for name, tensor in safetensors_of(back).items():
        assert torch.equal(tensor, mine[name]), name


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method='gptq'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size=[128]"),
    ],
)
def test_a_quantization_ckptctl_cannot_dequantize_is_refused_by_name(
    quantization: dict[str, object], named: str, tmp_path: Path, cli
) -> None:
    src = tmp_path / "fp8"
    _model(src)
    _quantise_checkpoint(src, (8, 8))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    result = cli("consolidate", src, tmp_path / "out", "--format", "hf", code=2)
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_fp8_weights_without_their_scales_are_refused_by_name(tmp_path: Path, cli) -> None:
    src = tmp_path / "fp8"
    _model(src)
    _quantise_checkpoint(src, (8, 8))
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    result = cli("consolidate", src, tmp_path / "out", "--format", "hf", code=3)
    assert "float8_e4m3fn but there is no quantization_config" in result.stderr, result.stderr


def test_fp8_block_writes_what_transformers_quantizes_and_verify_holds_it(
    tmp_path: Path, cli
) -> None:
    """``--dtype fp8-block``: every linear weight of attention and MLP becomes e4m3 with its
    ``weight_scale_inv``, bitwise what transformers' own ``Fp8Quantize`` makes of it (a
    partial block as it makes of the block padded with zeros); router, norms, embeddings and
    output layer stay bf16. ``verify --against`` passes within each weight's recorded error,
    and fails once the record claims less."""
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    src, out = tmp_path / "bf16", tmp_path / "fp8"
    _model(src, RELEASE_SIZED, seed=22)
    original = safetensors_of(src)
    cli("consolidate", src, out, "--format", "hf", "--dtype", "fp8-block")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    written = safetensors_of(out)
    theirs = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config()))
    quantized = [n for n in original if n + "_scale_inv" in written]
    assert len(quantized) == 2 * 5 + 3 + 4 * 3 + 3  # attention, dense MLP, experts, shared
    for name in quantized:
        weight = original[name]
        rows = -(-weight.shape[0] // 128) * 128
        padded = torch.nn.functional.pad(weight, (0, 0, 0, rows - weight.shape[0]))
        expected = theirs._quantize_one(name, padded)
        assert written[name].dtype == torch.float8_e4m3fn, name
        assert torch.equal(
            written[name].view(torch.uint8), expected[name][: weight.shape[0]].view(torch.uint8)
        ), name
        assert torch.equal(written[name + "_scale_inv"], expected[name + "_scale_inv"]), name
    for name, tensor in original.items():
        if name not in quantized:
            assert torch.equal(written[name], tensor), name
    report = cli.json("verify", out, "--against", src)
    assert report["ok"], report
    manifest_path = out / "ckptctl.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    bounds = manifest["quantized_max_abs_error"]
    assert len(bounds) == 2 * 5 + 2 + 4 * 2 + 2  # canonical tensors: gate and up are one
    assert all(0 < bound < 0.1 for bound in bounds.values()), bounds
    manifest["quantized_max_abs_error"] = {name: 0.0 for name in bounds}
    manifest_path.write_text(json.dumps(manifest))
    failed = json.loads(cli("verify", out, "--against", src, "--json", code=1).stdout)
    assert not failed["ok"], failed


def test_fp8_block_is_refused_where_the_format_cannot_hold_it(tmp_path: Path, cli) -> None:
    src = tmp_path / "bf16"
    _model(src, RELEASE_SIZED, seed=22)
    result = cli(
        "consolidate", src, tmp_path / "out", "--format", "megatron", "--dtype", "fp8-block", code=2
    )
    assert "--format megatron cannot hold block-scaled FP8" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
