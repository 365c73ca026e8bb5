"""``ckptctl merge-lora``, judged by PEFT: PEFT wraps a tiny seeded transformers Llama, its LoRA
matrices are set to seeded random values (B starts at zero), ``save_pretrained`` writes the
adapter, and ``merge_and_unload`` says what the merged model holds. A float32 base must come
out bit-equal; a bfloat16 base equal to PEFT's merge done in float32 and rounded once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base_model(dtype: torch.dtype, tied: bool = False) -> Any:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=301,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _adapter(model: Any, **options: Any) -> Any:
    """The model wrapped by PEFT, every LoRA matrix (and module trained whole) seeded random."""
    config = peft.LoraConfig(**{"target_modules": TARGETS, "r": 4, "lora_alpha": 8, **options})
    wrapped = peft.get_peft_model(model, config)
    seeded = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if any(k in name for k in ("lora_", "modules_to_save", "trainable_tokens")):
                param.copy_(torch.randn(param.shape, generator=seeded) * 0.1)
    return wrapped


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def _made(
    tmp: Path, dtype: torch.dtype, tied: bool = False, **options: Any
) -> tuple[Path, Path, dict[str, Any]]:
    """(base directory, adapter directory, the merged state dict PEFT makes, in float32 then
    rounded once to ``dtype``)."""
    base, adapter = tmp / "base", tmp / "adapter"
    _base_model(dtype, tied).save_pretrained(str(base))
    wrapped = _adapter(_base_model(dtype, tied), **options)
    wrapped.save_pretrained(str(adapter))
    # PEFT's own merge, in float32 (the base's weights and the adapter's, upcast exactly)
    model = _base_model(dtype, tied).float()
    reference = peft.PeftModel.from_pretrained(model, str(adapter))
    reference = reference.float()
    merged = reference.merge_and_unload().state_dict()
    return base, adapter, {k: v.to(dtype) for k, v in merged.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_merge_equals_peft_merge_and_unload(tmp_path: Path, cli, dtype: torch.dtype) -> None:
    base, adapter, merged = _made(
        tmp_path, dtype, rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 3}
    )
    result = cli("merge-lora", base, adapter, tmp_path / "out")
    assert "14 weights" in result.stdout + result.stderr
    ours = _tensors(tmp_path / "out")
    assert sorted(ours) == sorted(merged)
    changed = 0
    for name, want in merged.items():
        assert ours[name].dtype == dtype, name
        assert torch.equal(ours[name], want), name
        changed += not torch.equal(ours[name], _tensors(base)[name])
    assert changed == 14  # every adapted weight moved, nothing else
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert model.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_trained_whole_replace_the_bases(tmp_path: Path, cli, dtype: torch.dtype) -> None:
    """``modules_to_save``: PEFT keeps a trained copy of the module; the merged model holds
    it (in the base's dtype) instead of the base's."""
    base, adapter, merged = _made(tmp_path, dtype, modules_to_save=["lm_head", "embed_tokens"])
    cli("merge-lora", base, adapter, tmp_path / "out")
    ours = _tensors(tmp_path / "out")
    for name, want in merged.items():
        assert torch.equal(ours[name], want), name
    before = _tensors(base)
    assert not torch.equal(ours["lm_head.weight"], before["lm_head.weight"])
    assert not torch.equal(ours["model.embed_tokens.weight"], before["model.embed_tokens.weight"])


@pytest.mark.parametrize(("dtype", "tied"), [(torch.float32, False), (torch.bfloat16, True)])
def test_trained_token_rows_replace_the_embeddings(
    tmp_path: Path, cli, dtype: torch.dtype, tied: bool
) -> None:
    """``trainable_token_indices``: the trained rows replace those of the embedding (and,
    tied, of the output layer it is), as PEFT's merge copies them in."""
    base, adapter, merged = _made(tmp_path, dtype, tied, trainable_token_indices=[3, 7, 250])
    result = cli("merge-lora", base, adapter, tmp_path / "out")
    assert "3 trained rows of model.embed_tokens.weight" in result.stdout + result.stderr
    ours = _tensors(tmp_path / "out")
    assert sorted(ours) == sorted(k for k in merged if not (tied and k == "lm_head.weight"))
    for name in ours:
        assert torch.equal(ours[name], merged[name]), name
    changed = ours["model.embed_tokens.weight"] != _tensors(base)["model.embed_tokens.weight"]
    assert changed.any(dim=1).nonzero().flatten().tolist() == [3, 7, 250]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_and_output_layer_adapters(tmp_path: Path, cli, dtype: torch.dtype) -> None:
    """LoRA on ``embed_tokens`` (``lora_embedding_A``/``_B``: the delta transposed) and on
    ``lm_head``; PEFT saves both layers' base weights beside the adapter and loads them over
    the base's, so the merge starts from those."""
    targets = [*TARGETS, "embed_tokens", "lm_head"]
    base, adapter, merged = _made(tmp_path, dtype, target_modules=targets)
    cli("merge-lora", base, adapter, tmp_path / "out")
    ours = _tensors(tmp_path / "out")
    for name, want in merged.items():
        assert torch.equal(ours[name], want), name
    before = _tensors(base)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert not torch.equal(ours[name], before[name]), name


def test_rslora_scaling(tmp_path: Path, cli) -> None:
    base, adapter, merged = _made(tmp_path, torch.float32, use_rslora=True, lora_alpha=6)
    cli("merge-lora", base, adapter, tmp_path / "out")
    ours = _tensors(tmp_path / "out")
    for name, want in merged.items():
        assert torch.equal(ours[name], want), name


def test_a_megatron_base_merges_as_its_hf_form_does(tmp_path: Path, cli) -> None:
    """Any base ckptctl reads: the base resharded to Megatron TP2 PP2 merges to the same
    bytes as the HF base."""
    base, adapter, merged = _made(tmp_path, torch.bfloat16)
    cli("reshard", base, tmp_path / "meg", "--tp", "2", "--pp", "2")
    cli("merge-lora", tmp_path / "meg", adapter, tmp_path / "out", "--max-shard-size", "100KB")
    ours = _tensors(tmp_path / "out")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    for name, want in merged.items():
        assert torch.equal(ours[name], want), name


def test_sources_are_not_touched_and_a_rerun_of_another_adapter_is_not_reused(
    tmp_path: Path, cli
) -> None:
    base, adapter, _ = _made(tmp_path, torch.float32)
    before = {p: p.read_bytes() for d in (base, adapter) for p in d.rglob("*") if p.is_file()}
    cli("merge-lora", base, adapter, tmp_path / "out")
    after = {p: p.read_bytes() for d in (base, adapter) for p in d.rglob("*") if p.is_file()}
    assert after == before
    other = tmp_path / "other"
    shutil.copytree(adapter, other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 16}))
    result = cli("merge-lora", base, other, tmp_path / "out", code=2)
    assert "--overwrite" in result.stderr  # another plan's output: not taken as this one's


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 8}, "rank 4, the config says 8"),
        ({"some_new_field": 3}, "--trust-field some_new_field"),
        ({"rank_pattern": {"(o+)+_proj": 2}}, "repeats a group"),
    ],
)
def test_an_adapter_that_would_merge_otherwise_is_refused_by_name(
    tmp_path: Path, cli, change: dict[str, Any], named: str
) -> None:
    base, adapter, _ = _made(tmp_path, torch.float32)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    result = cli("merge-lora", base, adapter, tmp_path / "out", code=2)
    assert named in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_an_adapter_of_another_model_is_refused(tmp_path: Path, cli) -> None:
    base, _, _ = _made(tmp_path, torch.float32)
    model = _base_model(torch.float32)
    model.config.intermediate_size = 128
    bigger = transformers.LlamaForCausalLM(model.config)
    _adapter(bigger).save_pretrained(str(tmp_path / "bigger"))
    result = cli("merge-lora", base, tmp_path / "bigger", tmp_path / "out", code=2)
    assert "mlp.down_proj.weight is [64, 96] in the base" in result.stderr
    result = cli("merge-lora", base, tmp_path / "nothing", tmp_path / "out2", code=3)
    assert "adapter_config.json" in result.stderr


def test_an_adapter_given_as_a_checkpoint_points_to_merge_lora(tmp_path: Path, cli) -> None:
    """An HF Trainer's checkpoint of a PEFT model holds the adapter only: what to do next."""
    _, adapter, _ = _made(tmp_path, torch.float32)
    result = cli("inspect", adapter, code=3)
    assert "a PEFT adapter" in result.stderr and "ckptctl merge-lora BASE" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _vlm(dtype: torch.dtype) -> Any:
    """A tiny Qwen2.5-VL: its vision tower's patch embedding is a 3-D convolution."""
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=151,
            rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
        ),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64
        ),
        vocab_size=151,
    )
    torch.manual_seed(5)
    return transformers.Qwen2_5_VLForConditionalGeneration(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convolution_adapters_merge_as_peft_merges_them(
    tmp_path: Path, cli, dtype: torch.dtype
) -> None:
    """PEFT's convolution LoRA (``A`` a convolution of the layer's kernel, ``B`` a 1x1x1 one)
    on Qwen2.5-VL's 3-D patch embedding, beside a linear adapter of its language model: merged
    as PEFT's ``_ConvNd.get_delta_weight`` computes the delta (``A`` convolved with ``B``), and
    under the names ``save_pretrained`` writes (PEFT names the modules as transformers holds
    them in memory: ``model.language_model.*``, ``model.visual.*``): bit-equal to
    ``merge_and_unload`` saved by transformers, in float32 (bfloat16: PEFT's float32 merge
    rounded once)."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    _vlm(dtype).save_pretrained(str(base))
    config = peft.LoraConfig(target_modules=["patch_embed.proj", "q_proj"], r=4, lora_alpha=8)
    wrapped = peft.get_peft_model(_vlm(dtype), config)
    seeded = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=seeded) * 0.1)
    wrapped.save_pretrained(str(adapter))
    reference = peft.PeftModel.from_pretrained(_vlm(dtype).float(), str(adapter)).float()
    merged = reference.merge_and_unload().to(dtype)  # PEFT's float32 merge, rounded once
    merged.save_pretrained(str(tmp_path / "reference"))  # under the names transformers saves
    cli("merge-lora", base, adapter, tmp_path / "out")
    ours, want, before = (_tensors(tmp_path / d) for d in ("out", "reference", "base"))
    assert sorted(ours) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(ours[name], tensor), name
    conv = "visual.patch_embed.proj.weight"  # the hub's name (model.visual.* in memory)
    assert ours[conv].dim() == 5 and not torch.equal(ours[conv], before[conv])
    changed = [n for n in ours if not torch.equal(ours[n], before[n])]
    assert sorted(changed) == ["model.layers.0.self_attn.q_proj.weight", conv]
