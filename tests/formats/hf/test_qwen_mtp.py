"""The Qwen hybrids' multi-token prediction layer (issue 56): the hub's releases of Qwen3-Next
and Qwen3.5 keep one MTP layer under ``mtp.*`` (``tests/formats/hf/qwen_mtp.py``), which
transformers does not load. It becomes Megatron's MTP layer and comes back bit for bit; a
release without it (transformers saved it) is read without it, said; an MTP layer missing a
tensor, or more than the config announces, is refused by name.

megatron-core's own MTP layer judges the mapping in
``tests/formats/megatron/test_oracle_gdn.py`` (its MTP logits equal those transformers'
modules compute from the HF names ckptctl writes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.formats.hf.models import logits, tensors
from tests.formats.hf.qwen_mtp import add_hub_mtp
from tests.formats.hf.test_qwen35 import IDS, NEXT, SMALL, saved_hybrid

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

KINDS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
"""Two attention layers: the MTP layer is named as the first one (layer 1) in the release."""


def _release(root: Path, family: str) -> dict[str, torch.Tensor]:
    """A model of ``family`` transformers saved, with an MTP layer as the releases hold it."""
    if family == "Qwen3NextForCausalLM":
        config = transformers.Qwen3NextConfig(**NEXT, layer_types=KINDS)
    else:
        config = transformers.Qwen3_5TextConfig(**SMALL, layer_types=KINDS)
    saved_hybrid(config, root, seed=5)
    return add_hub_mtp(root, seed=6)


@pytest.mark.parametrize(
    ("family", "form", "cut"),
    [("Qwen3NextForCausalLM", "megatron", ["--ep", "2", "--etp", "1"]),
     ("Qwen3_5ForCausalLM", "torch_dist", [])],
)  # fmt: skip
def test_a_release_with_its_mtp_layer_goes_to_megatron_and_back_bit_exactly(
    tmp_path: Path, cli, family: str, form: str, cut: list[str]
) -> None:
    src = tmp_path / "hf"
    mtp = _release(src, family)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2", *cut, "--format", form)
    info = cli.json("inspect", megatron)
    assert info["spec"]["mtp_num_layers"] == 1
    assert info["hf"]["architecture"] == family
    last = sorted(megatron.rglob("mp_rank_*_001*/model_optim_rng.pt"))
    if form == "megatron":  # Megatron's MTP names, on the last stage, eh_proj cut by rows
        model = torch.load(last[0], weights_only=False)["model"]
        fc = mtp["mtp.fc.weight"]
        assert torch.equal(model["mtp.layers.0.eh_proj.weight"], fc[: fc.shape[0] // 2])
        enorm = mtp["mtp.pre_fc_norm_embedding.weight"]
        assert torch.equal(model["mtp.layers.0.enorm.weight"], enorm)
    against = cli.json("verify", megatron, "--against", src)
    assert against["ok"] and "mtp.layers.0.eh_proj.weight" in {
        t["name"] for t in against["tensors"] if t["equal"]
    }
    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    mine, theirs = tensors(back), tensors(src)
    assert mine.keys() == theirs.keys() and mtp.keys() <= mine.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    config = json.loads((back / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1 and config["architectures"] == [family]
    loaded, original = (
        transformers.AutoModelForCausalLM.from_pretrained(root).eval() for root in (back, src)
    )
    assert torch.equal(logits(loaded, IDS), logits(original, IDS))


def test_a_model_saved_without_its_mtp_layer_is_read_without_it(tmp_path: Path, cli) -> None:
    """transformers saves the model without ``mtp.*`` and keeps ``mtp_num_hidden_layers``."""
    src = tmp_path / "hf"
    _release(src, "Qwen3_5ForCausalLM")
    weights = {k: v for k, v in tensors(src).items() if not k.startswith("mtp.")}
    safetensors_torch.save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", "--format", "megatron")
    assert "holds no mtp.* weights" in result.stderr + result.stdout
    assert cli.json("inspect", tmp_path / "out")["spec"]["mtp_num_layers"] == 0


@pytest.mark.parametrize(
    ("change", "message", "code"),
    [("drop", "tensor mtp.norm.weight missing", 3),
     ("extra", "holds mtp.layers.1.input_layernorm.weight", 3),
     ("two", "one MTP layer maps, not 2 (mtp_num_hidden_layers", 2)],
)  # fmt: skip
def test_an_mtp_layer_ckptctl_cannot_place_is_refused_by_name(
    tmp_path: Path, cli, change: str, message: str, code: int
) -> None:
    src = tmp_path / "hf"
    _release(src, "Qwen3_5ForCausalLM")
    weights = tensors(src)
    if change == "drop":
        del weights["mtp.norm.weight"]
    elif change == "extra":
        weights["mtp.layers.1.input_layernorm.weight"] = weights["mtp.norm.weight"].clone()
    else:
        config = json.loads((src / "config.json").read_text())
        config["mtp_num_hidden_layers"] = 2
        (src / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", "--format", "megatron", code=code)
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
