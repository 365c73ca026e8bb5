"""The text decoder of a vision-language release (issue 56): Qwen3.5 and Qwen3.5-MoE come out as
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``, Gemma 3 as
``Gemma3ForConditionalGeneration``. With ``--text-only`` their decoder goes to Megatron (TP2 PP2)
and back to HF; the judge is transformers: the output equals, bit for bit, the text model
transformers itself loads from the release (``AutoModelForCausalLM`` on a Qwen3.5 release: its
own renaming, vision tower dropped), and its logits on text equal the vision-language model's.
Gemma 3 is read in the layout its releases use and transformers 5 still saves (LLaVA's
``language_model.model.*``) and in the one transformers holds in memory
(``model.language_model.*``), as other code saves its state dict. Without the flag the decoder
is refused with the flag named; the flag on anything else is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.formats.hf.models import logits, tensors
from tests.formats.hf.qwen_mtp import add_hub_mtp

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 300
IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
TEXT = dict(
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
)
LINEAR = dict(
    # what the releases' text configs say beside the sizes, which transformers' classes do
    # not read: always true / swish there, an inference engine's state dtype, an MTP layer
    attn_output_gate=True,
    output_gate_type="swish",
    mamba_ssm_dtype="float32",
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    # as the releases hold them: sections of the rotary angles, one position each for text
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
)
QWEN_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
SIGLIP = dict(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=16,
    patch_size=4,
)


def _config(kind: str) -> object:
    if kind == "qwen3_5":
        return transformers.Qwen3_5Config(
            text_config={**TEXT, **LINEAR}, vision_config=QWEN_VISION, tie_word_embeddings=False
        )
    if kind == "qwen3_5_moe":
        text = {k: v for k, v in TEXT.items() if k != "intermediate_size"} | LINEAR
        text |= dict(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            num_experts=4,
            num_experts_per_tok=2,
        )
        return transformers.Qwen3_5MoeConfig(
            text_config=text, vision_config=QWEN_VISION, tie_word_embeddings=False
        )
    return transformers.Gemma3Config(
        text_config={**TEXT, "sliding_window": 3},
        vision_config=SIGLIP,
        mm_tokens_per_image=4,
    )


def _release(kind: str, root: Path, shard: str | None = None) -> torch.nn.Module:
    """A vision-language model as transformers saves it, parameters ~ N(0, 0.2) (gated norms
    near one, as a trained model's are: HF stores one plus Megatron's zero-centred weight)."""
    config = _config(kind)
    model_class = {
        "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
    }.get(kind, transformers.Gemma3ForConditionalGeneration)
    torch.manual_seed(4)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.2)
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
    model.save_pretrained(root, **({"max_shard_size": shard} if shard else {}))
    if kind.startswith("qwen3_5") and shard is None:  # the release's MTP layer (at the top)
        add_hub_mtp(root, seed=7, decoder="model.language_model.")
    return model.eval()


def _in_memory_names(root: Path) -> None:
    """``root``'s Gemma 3 weights renamed from the layout transformers saves (its releases',
    LLaVA's) to the one it holds in memory (``model.language_model.*``), as a state dict
    saved by other code has them."""
    path = root / "model.safetensors"
    renames = (
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
    out = {}
    for name, tensor in safetensors_torch.load_file(path).items():
        old, new = next(((o, n) for o, n in renames if name.startswith(o)), ("", ""))
        out[new + name.removeprefix(old)] = tensor
    safetensors_torch.save_file(out, path, metadata={"format": "pt"})


def _decoder(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors by its own names, from what its vision-language model saved
    (Qwen3.5: ``model.language_model.*``; Gemma 3: ``language_model.model.*``)."""
    out = {}
    for name, tensor in saved.items():
        for prefix in ("model.language_model.", "language_model.model."):
            if name.startswith(prefix):
                out["model." + name.removeprefix(prefix)] = tensor
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            out["lm_head.weight"] = tensor
        if name.startswith("mtp."):  # the decoder's MTP layer, at the top of the release
            out[name] = tensor
    return out


def _loaded_anew(root: Path) -> torch.nn.Module:
    """``root``'s model with its parameters copied out of the mapped file (CPU kernels round by
    their operands' alignment, which differs with a tensor's place in the file)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return model


@pytest.mark.parametrize(
    ("kind", "text_model", "form"),
    [
        ("qwen3_5", "Qwen3_5ForCausalLM", "megatron"),
        ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "torch_dist"),
        ("gemma3", "Gemma3ForCausalLM", "megatron"),
        ("gemma3-in-memory", "Gemma3ForCausalLM", "torch_dist"),
    ],
)
def test_the_text_decoder_goes_to_megatron_and_back_as_transformers_reads_it(
    tmp_path: Path, cli, kind: str, text_model: str, form: str
) -> None:
    src = tmp_path / "release"
    model = _release(kind.removesuffix("-in-memory"), src)
    decoder = _decoder(tensors(src))
    if kind.endswith("-in-memory"):
        _in_memory_names(src)
        again = type(model).from_pretrained(src, dtype=torch.float32).eval()
        assert torch.equal(logits(again, IDS), logits(model, IDS))  # transformers reads it so
    # the decoder's, LLaVA's, and the decoder's MTP layer
    decoder_prefixes = ("model.language_model.", "language_model.", "lm_head.", "mtp.")
    omitted = sum(not name.startswith(decoder_prefixes) for name in tensors(src))
    info = cli.json("inspect", src, "--text-only")
    assert any(f"{omitted} tensors outside it" in note for note in info["notes"]), info["notes"]
    if kind.startswith("qwen3_5"):
        assert any("model.visual.*" in n and "mtp" not in n for n in info["notes"]), info
        assert info["spec"]["mtp_num_layers"] == 1
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    args = ["--tp", "2", "--pp", "2", "--format", form, "--text-only"]
    if kind == "qwen3_5_moe":
        args += ["--ep", "2", "--etp", "1"]
    result = cli("reshard", src, megatron, *args)
    assert f"{omitted} tensors outside it" in result.stderr + result.stdout
    cli("consolidate", megatron, back, "--format", "hf")

    mine = tensors(back)
    assert mine.keys() == decoder.keys()
    for name, tensor in decoder.items():
        assert torch.equal(mine[name], tensor), name
    loaded = _loaded_anew(back)
    assert type(loaded).__name__ == text_model
    assert torch.equal(logits(loaded, IDS), logits(model, IDS))
    if kind.startswith("qwen3_5"):  # transformers' own reading of the release's text model
        theirs = _loaded_anew(src)
        assert type(theirs).__name__ == text_model
        assert torch.equal(logits(theirs, IDS), logits(loaded, IDS))
        for name, tensor in theirs.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name


def test_without_the_flag_the_decoder_is_refused_naming_it(tmp_path: Path, cli) -> None:
    """Gemma 3's release: HF -> HF by name keeps every tensor, vision tower and all; Megatron is
    refused. Qwen3.5's also holds its MTP layer, which transformers' class has no place for:
    refused either way. Each refusal names ``--text-only``."""
    gemma, qwen = tmp_path / "gemma", tmp_path / "qwen"
    _release("gemma3", gemma)
    _release("qwen3_5", qwen)
    cli("consolidate", gemma, tmp_path / "whole", "--format", "hf")
    assert tensors(tmp_path / "whole").keys() == tensors(gemma).keys()
    for src, code in ((gemma, 2), (qwen, 3)):
        out = tmp_path / "out"
        result = cli("reshard", src, out, "--tp", "2", "--format", "megatron", code=code)
        assert "--text-only" in result.stderr and "Traceback" not in result.stderr
        assert not out.exists()
    result = cli("consolidate", qwen, tmp_path / "out", "--format", "hf", code=3)
    assert "mtp.fc.weight" in result.stderr and "--text-only" in result.stderr


def test_a_release_in_several_files_is_read_through_its_index(tmp_path: Path, cli) -> None:
    """As the releases are: the decoder's and the vision tower's tensors spread over several
    files, some holding vision tensors only."""
    src = tmp_path / "release"
    model = _release("qwen3_5", src, shard="100KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    cli("reshard", src, megatron, "--tp", "2", "--pp", "2", "--format", "megatron", "--text-only")
    cli("consolidate", megatron, back, "--format", "hf")
    mine, decoder = tensors(back), _decoder(tensors(src))
    assert mine.keys() == decoder.keys()
    for name, tensor in decoder.items():
        assert torch.equal(mine[name], tensor), name
    assert torch.equal(logits(_loaded_anew(back), IDS), logits(model, IDS))
    # verify --against the release: --text-only reads the reference's decoder
    report = cli.json("verify", back, "--against", src, "--text-only")
    assert report["ok"] and report["against"], report
    assert all(t["equal"] for t in report["tensors"]), report["tensors"]  # none one-sided
    result = cli("verify", back, "--text-only", code=2)
    assert "give --against too" in result.stderr


def test_the_flag_where_there_is_no_vision_model_is_refused(tmp_path: Path, cli) -> None:
    src = tmp_path / "release"
    _release("qwen3_5", src)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--format", "megatron", "--text-only")
    text = tmp_path / "text"
    cli("consolidate", megatron, text, "--format", "hf")
    assert "text_config" not in json.loads((text / "config.json").read_text())
    for source, says in ((text, "has no text_config"), (megatron, "this is a megatron")):
        result = cli("consolidate", source, tmp_path / "again", "--format", "hf", "--text-only",
                     code=2)  # fmt: skip
        assert says in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / "again").exists()
