"""GPT-OSS (issue 56): a model transformers builds goes to Megatron (TP2 PP2 EP2) and back bit
for bit with transformers' logits unchanged: attention sinks (megatron-core's learnable
softmax offset), biases on every linear, the clamped quick-GEGLU experts (packed, transposed,
gate and up interleaved in HF; Megatron's ``[gate; up]`` per expert), the sliding window on
every other layer and YaRN, all in Megatron-LM's own argument names. What Megatron cannot say
is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.formats.hf.models import logits, saved_model, tensors

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

IDS = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(5))
MEGATRON_ARGS = {
    "quick_geglu": True,
    "swiglu": False,
    "glu_linear_offset": 1.0,
    "activation_func_clamp_value": 7.0,
    "softmax_type": "learnable",
    "add_bias_linear": True,
    "window_size": (3, 0),
    "window_attn_skip_freq": [1, 0, 1, 0],
    "position_embedding_type": "yarn",
    "rotary_scaling_factor": 32.0,
    "yarn_correction_range_round_to_int": False,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_router_pre_softmax": False,
}


def _make(root: Path, **extra: object) -> torch.nn.Module:
    fields: dict[str, object] = dict(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=131072,
    )
    config = transformers.GptOssConfig(**{**fields, **extra})
    return saved_model(config, root, seed=0)


def test_gpt_oss_goes_to_megatron_and_back_bit_exactly(tmp_path: Path, cli) -> None:
    src = tmp_path / "hf"
    model = _make(src)
    megatron = tmp_path / "megatron"
    layout = ["--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1", "--dp", "2"]
    cli("reshard", src, megatron, *layout)
    rank = next(megatron.rglob("model_optim_rng.pt"))
    state = torch.load(rank, weights_only=False)
    args = vars(state["args"])
    assert {k: args[k] for k in MEGATRON_ARGS} == MEGATRON_ARGS
    # each TP rank holds its heads' sinks; the experts' fc1 is [gate; up] per rank
    assert state["model"][
        "decoder.layers.0.self_attention.core_attention.softmax_offset"
    ].shape == (2,)
    info = cli.json("inspect", megatron)
    assert info["hf"]["architecture"] == "GptOssForCausalLM"

    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf", "--max-shard-size", "200KB")
    assert len(list(back.glob("*.safetensors"))) > 1  # packed experts kept whole in a file
    mine, theirs = tensors(back), tensors(src)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert loaded.config.layer_types == model.config.layer_types
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0}  # YaRN's, left out when at them
    assert {**defaults, **loaded.config.rope_parameters} == model.config.rope_parameters
    assert torch.equal(logits(loaded, IDS), logits(model, IDS))
    assert cli.json("verify", back, "--against", megatron)["ok"]


def test_one_experts_megatron_tensors_are_hfs_deinterleaved(tmp_path: Path, cli) -> None:
    """What Megatron holds, judged against HF's own tensors: expert 3 (EP rank 1's second,
    whole: expert TP 1) has ``linear_fc1`` ``[gate; up]`` out of HF's interleaved, transposed
    ``gate_up_proj``, its bias likewise, and ``linear_fc2`` ``down_proj`` transposed."""
    src = tmp_path / "hf"
    _make(src)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--ep", "2", "--etp", "1", "--dp", "2")
    hf = tensors(src)
    gate_up = hf["model.layers.2.mlp.experts.gate_up_proj"][3].T  # [2F, H]
    bias = hf["model.layers.2.mlp.experts.gate_up_proj_bias"][3]
    path = next(megatron.rglob("mp_rank_01_001/model_optim_rng.pt"))
    model = torch.load(path, weights_only=False)["model"]
    expert = "decoder.layers.2.mlp.experts.local_experts.1."
    assert torch.equal(
        model[expert + "linear_fc1.weight"], torch.cat([gate_up[0::2], gate_up[1::2]])
    )
    assert torch.equal(model[expert + "linear_fc1.bias"], torch.cat([bias[0::2], bias[1::2]]))
    down = hf["model.layers.2.mlp.experts.down_proj"][3].T  # [H, F]
    assert torch.equal(model[expert + "linear_fc2.weight"], down)


def test_expert_tp_above_one_is_refused_before_writing(tmp_path: Path, cli) -> None:
    src = tmp_path / "hf"
    _make(src)
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", "--ep", "2", "--dp", "2", code=2)
    assert "megatron-core holds expert biases (add_bias_linear) only with expert TP 1" in (
        result.stderr
    )
    assert "--etp 1" in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
        ({"attention_bias": False}, "attention_bias=false"),
    ],
)
def test_what_megatron_cannot_say_is_refused_by_name(
    extra: dict[str, object], named: str, tmp_path: Path, cli
) -> None:
    src = tmp_path / "hf"
    _make(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **extra}))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=2)
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_megatron_gpt_oss_is_written_in_mxfp4_as_openai_releases_it(tmp_path: Path, cli) -> None:
    """``--dtype mxfp4``: the experts as ``*_blocks`` / ``*_scales`` in the release's shapes
    and ``quantization_config``; transformers' MXFP4 load reads the same values ckptctl does,
    the rest of the model bit for bit; each expert's error is recorded, is the real one, and
    ``verify --against`` holds the file to it."""
    src = tmp_path / "hf"
    _make(src, intermediate_size=64)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, "--tp", "2", "--ep", "2", "--etp", "1", "--dp", "2")
    out = tmp_path / "mxfp4"
    cli("consolidate", megatron, out, "--format", "hf", "--dtype", "mxfp4")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    stored = tensors(out)
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 128, 2, 16)
    assert stored["model.layers.0.mlp.experts.down_proj_scales"].dtype == torch.uint8
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).state_dict()
    again = tmp_path / "read"  # ckptctl's own reading of the MXFP4 file
    cli("consolidate", out, again, "--format", "hf")
    mine, source = tensors(again), tensors(src)
    manifest = json.loads((out / "ckptctl.manifest.json").read_text())
    recorded = manifest["quantized_max_abs_error"]
    assert len(recorded) == 4 * 4 * 2  # layers x experts x (fc1, fc2)
    for name, tensor in source.items():
        assert torch.equal(mine[name].float(), theirs[name].float()), name
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            error = (mine[name].float() - tensor).abs().amax(dim=(1, 2))
            fc = "linear_fc1" if "gate_up" in name else "linear_fc2"
            layer = name.split(".")[2]
            for expert, value in enumerate(error.tolist()):
                key = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{fc}.weight"
                assert 0 < value == pytest.approx(recorded[key], rel=1e-6), key
        else:
            assert torch.equal(mine[name], tensor), name
    assert cli.json("verify", out, "--against", src)["ok"]


def test_fp8_block_is_refused_for_gpt_oss(tmp_path: Path, cli) -> None:
    """DeepSeek's FP8 form quantizes each linear weight as one tensor: GPT-OSS's experts are
    blocks of packed tensors (and its release form is MXFP4), so it is refused, not written."""
    src = tmp_path / "hf"
    _make(src)
    result = cli(
        "consolidate", src, tmp_path / "out", "--format", "hf", "--dtype", "fp8-block", code=2
    )
    assert "GPT-OSS's experts are packed" in result.stderr and "--dtype mxfp4" in result.stderr
    assert not (tmp_path / "out").exists()


def test_mxfp4_is_written_for_gpt_oss_only(tmp_path: Path, cli) -> None:
    src = tmp_path / "hf"
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=300,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(src)
    result = cli("consolidate", src, tmp_path / "out", "--format", "hf", "--dtype", "mxfp4", code=2)
    assert "writes GPT-OSS's expert weights" in result.stderr
    assert not (tmp_path / "out").exists()


def test_readers_and_writers_by_hf_name_refuse_gpt_oss_by_name(tmp_path: Path) -> None:
    """Formats that take each HF name as one tensor (DeepSpeed, the HF Trainer's optimizer,
    merge-lora) would misplace the packed experts: they ask for the tensors through
    ``per_name_tensors``, which refuses GPT-OSS, saying why (DCP, torchtitan, verl and
    accelerate place the experts block by block: tests/formats/dcp, tests/formats/verl)."""
    from ckptctl.errors import LayoutError
    from ckptctl.model.hf_config import spec_from_config
    from ckptctl.model.hf_layout import per_name_tensors

    src = tmp_path / "hf"
    _make(src)
    spec = spec_from_config(json.loads((src / "config.json").read_text()))
    with pytest.raises(LayoutError, match="GPT-OSS's packed experts are read from HF"):
        per_name_tensors(spec, "DCP")


def test_a_gpt_oss_dcp_checkpoint_converts_to_hf(tmp_path: Path, cli) -> None:
    """A GPT-OSS model's state dict saved with torch's own DCP (as FSDP trainers save it; one
    process here), its config beside: to HF, its experts placed block by block and written
    back packed, every tensor as the model holds it (FSDP2 and Adam's state:
    tests/formats/dcp/test_dcp_hf_any.py)."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "hf"
    model = _make(src)
    run = tmp_path / "dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(run))
    (run / "config.json").write_text((src / "config.json").read_text())
    out = tmp_path / "out"
    cli("consolidate", run, out, "--format", "hf")
    mine, theirs = tensors(out), tensors(src)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[n], t) for n, t in theirs.items())


def test_mxfp4_is_refused_for_a_model_carried_by_name(tmp_path: Path, cli) -> None:
    src = tmp_path / "hf"
    _make(src, swiglu_alpha=1.5)  # no Megatron mapping: carried by name
    result = cli("consolidate", src, tmp_path / "out", "--format", "hf", "--dtype", "mxfp4", code=2)
    assert "GptOssForCausalLM is carried by name only" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_packed_chunk_cut_inside_an_experts_block_is_not_placed(tmp_path: Path) -> None:
    """DCP / verl chunks of a packed expert tensor are placed expert by expert only when they
    hold whole experts (FSDP cuts dim 0); a chunk cut inside one (fewer experts than ranks) is
    not placed, never placed wrong: the DCP view names it, the named placement leaves it."""
    from ckptctl.formats.named import _block_views
    from ckptctl.model.geometry import Piece
    from ckptctl.model.hf_config import spec_from_config
    from ckptctl.model.hf_state_dict import block_chunk, block_table
    from ckptctl.model.stored import StoredTensor

    src = tmp_path / "hf"
    _make(src)
    spec = spec_from_config(json.loads((src / "config.json").read_text()))
    table = block_table(spec, "model.", "optim.state.")
    name = "model.model.layers.0.mlp.experts.gate_up_proj"
    key = table[name]
    assert key.shape == (4, 64, 64) and key.transposed and key.interleaved
    whole = block_chunk(name, key, (2, 0, 0), (2, 64, 64), "float32")
    assert whole is not None and [t.view_offset for t in whole] == [0, 64 * 64]
    assert [t.canonical for t in whole] == [c for c, *_ in key.experts[2:]]
    assert block_chunk(name, key, (1, 32, 0), (1, 32, 64), "float32") is None
    cut = StoredTensor(
        (name,), name, (1, 32, 64), "float32", (Piece((0, 0, 0), (1, 32, 0), (1, 32, 64)),)
    )
    assert _block_views(cut, key) is None
    assert table["optim.state.model.layers.0.mlp.experts.gate_up_proj.step"].shape == ()
