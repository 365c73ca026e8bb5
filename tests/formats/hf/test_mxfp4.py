"""GPT-OSS released in MXFP4 (issue 56): its experts are read dequantized bit for bit as
transformers' own ``Mxfp4Dequantize`` does, so ``consolidate --format hf`` writes the bf16
model transformers builds from the release (the common "dequantize GPT-OSS" step), any box of
an expert tensor reads as the same box of transformers' tensor, and what the release's
quantization settings say beyond what is read is refused by name.

The MXFP4 release is made here from a GPT-OSS model transformers builds: its packed expert
weights replaced by random FP4 codes (every code) and random block scales, in the release's
names and shapes (``*_blocks`` uint8 ``[E, out, in / 32, 16]``, ``*_scales`` ``[E, out, in /
32]``); transformers then judges it, loading it with ``Mxfp4Config(dequantize=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

IDS = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
PACKED = ("experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss")
    config = transformers.GptOssConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=131072,  # YaRN's 32 x 4096
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / "bf16")
    tensors = safetensors_torch.load_file(root / "bf16" / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    out = {}
    for name, tensor in tensors.items():
        if not name.endswith(PACKED):
            out[name] = tensor
            continue
        experts, inputs, outputs = tensor.shape
        shape = (experts, outputs, inputs // 32)
        out[name + "_blocks"] = torch.randint(
            0, 256, (*shape, 16), generator=generator, dtype=torch.uint8
        )
        out[name + "_scales"] = torch.randint(110, 135, shape, generator=generator).to(torch.uint8)
    src = root / "mxfp4"
    src.mkdir()
    half = len(out) // 2  # two files: blocks and scales of a layer may sit apart
    names = sorted(out)
    safetensors_torch.save_file({n: out[n] for n in names[:half]}, src / "model-1.safetensors")
    safetensors_torch.save_file({n: out[n] for n in names[half:]}, src / "model-2.safetensors")
    index = {n: f"model-{1 + (i >= half)}.safetensors" for i, n in enumerate(names)}
    total = sum(t.numel() * t.element_size() for t in out.values())
    body = {"metadata": {"total_size": total}, "weight_map": index}
    (src / "model.safetensors.index.json").write_text(json.dumps(body))
    saved = json.loads((root / "bf16" / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**saved, "quantization_config": QUANTIZATION}))
    return src


def _dequantized_by_transformers(src: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        src,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.bfloat16,
    ).eval()


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(path))
    return out


def test_an_mxfp4_release_dequantizes_as_transformers_does(
    release: Path, tmp_path: Path, cli
) -> None:
    theirs = _dequantized_by_transformers(release)
    info = cli.json("inspect", release)
    assert any("4 expert weights stored in MXFP4, read as bfloat16" in n for n in info["notes"])

    out = tmp_path / "bf16"
    cli("consolidate", release, out, "--format", "hf")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    mine, state = _tensors(out), theirs.state_dict()
    assert mine.keys() == state.keys()
    for name, tensor in state.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, theirs(IDS).logits)
    assert cli.json("verify", out, "--against", release)["ok"]


def _boxes(shape: tuple[int, ...], generator: torch.Generator, count: int = 6):
    """Random boxes of ``shape``, starting and ending anywhere (inside 32-element blocks)."""
    for _ in range(count):
        lo = [int(torch.randint(0, n, (1,), generator=generator)) for n in shape]
        hi = [
            int(torch.randint(a + 1, n + 1, (1,), generator=generator))
            for a, n in zip(lo, shape, strict=True)
        ]
        yield tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True))


def _read(ckpt, stored, tensor, lo, sizes):
    from ckptctl.arrays import to_torch

    view = None if tensor.view_offset is None else (tensor.view_offset, tensor.shape)
    got = ckpt.read(stored.path, tensor.key, lo, sizes, view, transposed=tensor.transposed)
    return to_torch(got)


def test_any_box_of_an_expert_reads_as_transformers_dequantizes_it(release: Path) -> None:
    """Read for Megatron (GPT-OSS's family table): each expert's ``linear_fc1`` /
    ``linear_fc2`` out of the packed MXFP4 tensors, transposed, gate and up rows apart."""
    from ckptctl.formats.hf.reader import probe_hf
    from ckptctl.io.storage import Storage

    state = _dequantized_by_transformers(release).state_dict()
    ckpt = probe_hf(Storage(str(release)))
    generator = torch.Generator().manual_seed(8)
    checked = 0
    for stored in ckpt.view.files:
        for tensor in stored.tensors:
            name = str(tensor.key[0])
            if not name.endswith(PACKED):
                continue
            expert = tensor.view_offset // tensor.numel
            megatron = state[name][expert].T  # [out, in]
            if name.endswith("gate_up_proj"):  # gate columns are the even ones
                megatron = torch.cat([megatron[0::2], megatron[1::2]])
            for lo, sizes in _boxes(tensor.shape, generator):
                want = megatron[tuple(slice(a, a + n) for a, n in zip(lo, sizes, strict=True))]
                got = _read(ckpt, stored, tensor, lo, sizes)
                assert torch.equal(got, want), (tensor.canonical, lo, sizes)
                checked += 1
    assert checked == 2 * 2 * 4 * 6  # layers x packed weights x experts x boxes


def test_a_gpt_oss_variant_without_a_megatron_mapping_still_dequantizes_by_name(
    release: Path, tmp_path: Path, cli
) -> None:
    """A GPT-OSS config ckptctl cannot map to Megatron (another sigmoid gain) is carried by
    name: its packed MXFP4 tensors read, any box, as transformers dequantizes them."""
    from ckptctl.formats.hf.reader import probe_hf
    from ckptctl.io.storage import Storage

    src = tmp_path / "src"
    src.mkdir()
    for path in release.iterdir():
        (src / path.name).symlink_to(path)
    (src / "config.json").unlink()
    config = json.loads((release / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "swiglu_alpha": 1.5}))
    state = _dequantized_by_transformers(src).state_dict()
    ckpt = probe_hf(Storage(str(src)))
    assert ckpt.view.spec is None  # by name
    generator = torch.Generator().manual_seed(9)
    checked = 0
    for stored in ckpt.view.files:
        for tensor in stored.tensors:
            if not tensor.canonical.endswith(PACKED):
                continue
            for lo, sizes in _boxes(tensor.shape, generator):
                want = state[tensor.canonical][
                    tuple(slice(a, a + n) for a, n in zip(lo, sizes, strict=True))
                ]
                assert torch.equal(_read(ckpt, stored, tensor, lo, sizes), want)
                checked += 1
    assert checked == 4 * 6
    out = tmp_path / "out"
    cli("consolidate", src, out, "--format", "hf")
    mine = _tensors(out)
    assert all(torch.equal(mine[n], t) for n, t in state.items())


@pytest.mark.parametrize(
    ("edit", "named", "code"),
    [
        (
            {"quantization_config": {**QUANTIZATION, "bits": 4}},
            "quantization_config.bits=4: unknown to ckptctl",
            3,
        ),
        (
            {"quantization_config": {"quant_method": "awq"}},
            "quant_method='awq'; ckptctl dequantizes block-scaled FP8",
            2,
        ),
    ],
)
def test_quantization_settings_not_read_are_refused_by_name(
    release: Path, edit: dict[str, object], named: str, code: int, tmp_path: Path, cli
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for path in release.iterdir():
        (src / path.name).symlink_to(path)
    (src / "config.json").unlink()
    config = json.loads((release / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **edit}))
    result = cli("consolidate", src, tmp_path / "out", "--format", "hf", code=code)
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_blocks_without_their_scales_are_refused_by_name(
    release: Path, tmp_path: Path, cli
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    index = json.loads((release / "model.safetensors.index.json").read_text())
    for path in release.glob("*.safetensors"):
        tensors = safetensors_torch.load_file(path)
        kept = {
            n: t for n, t in tensors.items() if n != "model.layers.1.mlp.experts.down_proj_scales"
        }
        safetensors_torch.save_file(kept, src / path.name)
    del index["weight_map"]["model.layers.1.mlp.experts.down_proj_scales"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text((release / "config.json").read_text())
    result = cli("consolidate", src, tmp_path / "out", "--format", "hf", code=3)
    assert "model.layers.1.mlp.experts.down_proj_blocks is without its scales" in result.stderr
    assert not (tmp_path / "out").exists()


def test_an_mxfp4_release_goes_to_megatron_and_back_as_its_bf16_model(
    release: Path, tmp_path: Path, cli
) -> None:
    """MXFP4 -> Megatron (TP2 PP2 EP2): the experts dequantized on the way; back to HF, the
    model transformers' dequantizing load builds, bit for bit."""
    state = _dequantized_by_transformers(release).state_dict()
    megatron = tmp_path / "megatron"
    cli(
        "reshard",
        release,
        megatron,
        "--tp",
        "2",
        "--pp",
        "2",
        "--ep",
        "2",
        "--etp",
        "1",
        "--dp",
        "2",
    )
    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    mine = _tensors(back)
    assert mine.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(mine[name], tensor), name
