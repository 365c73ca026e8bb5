"""DCP checkpoints of HF models ckptctl has no family table for, or holds in transformers 5's
in-memory naming, judged by torch and transformers: FSDP2 (2 gloo processes, one Adam step,
``oracles/fsdp2_hf_any_writer``) writes the checkpoint; transformers' own ``save_pretrained`` of
the trained weights says what the HF checkpoint must hold, and its forward judges the output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests.formats.megatron.rank_files import holds, optimizer_tensors
from tests.oracle_runner import run_oracle

transformers = pytest.importorskip("transformers")

ORACLE = "fsdp2_hf_any_writer.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _written(tmp_path_factory: pytest.TempPathFactory, model: str, tp: int = 1) -> Path:
    out = tmp_path_factory.mktemp(f"{model}_tp{tp}")
    run_oracle(ORACLE, model, out, "--tp", tp, timeout=300)
    return out


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _written(tmp_path_factory, "qwen2_5_vl")


@pytest.fixture(scope="module")
def vlm_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP2 over TP 2 (4 processes): the language model's weights are _StridedShard DTensors."""
    return _written(tmp_path_factory, "qwen2_5_vl", tp=2)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _written(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def moe_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE under FSDP2 over TP 2 (4 processes): attention and dense MLP strided shards,
    experts packed and sharded over DP."""
    return _written(tmp_path_factory, "qwen3_moe", tp=2)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _written(tmp_path_factory, "gemma3")


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _written(tmp_path_factory, "qwen3_5")


@pytest.fixture(scope="module")
def gemma3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _written(tmp_path_factory, "gemma3_vl")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _written(tmp_path_factory, "gpt_oss")


def _truth(run: Path) -> dict[str, Any]:
    return torch.load(run / "truth.pt", weights_only=False)


def _saved_by_transformers(run: Path, out: Path) -> None:
    """The trained weights put in a fresh model and saved by ``save_pretrained``: the HF
    checkpoint a user expects."""
    config = transformers.AutoConfig.from_pretrained(str(run / "dcp"))
    cls = getattr(transformers, config.architectures[0])
    model = cls(config).float()
    model.load_state_dict(_truth(run)["model"], strict=True)
    model.save_pretrained(str(out))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def _loaded(directory: Path) -> Any:
    config = transformers.AutoConfig.from_pretrained(str(directory))
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _as_save_pretrained_writes(run: Path, hf: Path, reference: Path) -> dict[str, Any]:
    """``hf`` holds exactly the tensors ``save_pretrained`` writes of the run's trained weights
    (saved to ``reference``), bit for bit, and gives the logits of that saved model; the
    tensors, for further checks."""
    _saved_by_transformers(run, reference)
    ours, theirs = _tensors(hf), _tensors(reference)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    tokens = _truth(run)["input_ids"]
    assert torch.equal(_logits(_loaded(hf), tokens), _logits(_loaded(reference), tokens))
    return ours


def test_a_vlm_under_fsdp2_becomes_the_checkpoint_save_pretrained_writes(
    vlm: Path, tmp_path: Path, cli
) -> None:
    """Vision tower, transformers 5's ``model.language_model.*`` and tied embeddings: the
    output holds exactly the tensors ``save_pretrained`` writes, bit for bit, its config files
    are the source's, and transformers' forward of it gives the trained model's logits."""
    cli("consolidate", vlm / "dcp", tmp_path / "hf", "--max-shard-size", "300KiB")
    ours = _as_save_pretrained_writes(vlm, tmp_path / "hf", tmp_path / "reference")
    assert any(name.startswith("visual.") for name in ours)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "hf" / name).read_text()) == json.loads(
            (vlm / "dcp" / name).read_text()
        )
    truth = _truth(vlm)
    logits = _logits(_loaded(tmp_path / "hf"), truth["input_ids"])
    assert torch.equal(logits, truth["logits"])
    # The source holds Adam's state too, which HF does not: weights are what is compared.
    report = cli.json("verify", tmp_path / "hf", "--against", vlm / "dcp", "--weights-only")
    assert report["ok"] and report["against"]["compared"] == len(ours)
    info = cli.json("inspect", tmp_path / "hf")
    assert info["hf"]["architecture"] == "Qwen2_5_VLForConditionalGeneration"


def test_a_vlm_under_fsdp2_over_tensor_parallelism_becomes_its_hf_checkpoint(
    vlm_tp: Path, tmp_path: Path, cli
) -> None:
    """2-D FSDP + TP: DCP stores each rank's strided shard as a box of the global tensor; the
    HF output is what save_pretrained writes of the trained weights, bit for bit."""
    cli("consolidate", vlm_tp / "dcp", tmp_path / "hf")
    _as_save_pretrained_writes(vlm_tp, tmp_path / "hf", tmp_path / "reference")
    truth = _truth(vlm_tp)
    logits = _logits(_loaded(tmp_path / "hf"), truth["input_ids"])
    # The live model reduced its row-parallel outputs over TP ranks: the same to rounding.
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-6)


def test_a_moe_under_fsdp2_over_tensor_parallelism_becomes_its_hf_checkpoint(
    moe_tp: Path, tmp_path: Path, cli
) -> None:
    """transformers 5's Qwen3-MoE trained a step under FSDP2 + TP on 4 gloo processes: the
    HF output is what save_pretrained writes (hub per-expert tensors), bit for bit, and its
    logits are the trained model's."""
    cli("consolidate", moe_tp / "dcp", tmp_path / "hf")
    _as_save_pretrained_writes(moe_tp, tmp_path / "hf", tmp_path / "reference")
    truth = _truth(moe_tp)
    logits = _logits(_loaded(tmp_path / "hf"), truth["input_ids"])
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-6)


def test_a_model_known_by_name_only_converts_to_hf_but_not_to_megatron(
    vlm: Path, tmp_path: Path, cli
) -> None:
    cli("consolidate", vlm / "dcp", tmp_path / "bf16", "--dtype", "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    tensors = _tensors(tmp_path / "bf16")
    truth = _truth(vlm)["model"]
    want = truth["model.visual.blocks.0.attn.qkv.weight"].to(torch.bfloat16)
    assert torch.equal(tensors["visual.blocks.0.attn.qkv.weight"], want)
    result = cli("reshard", vlm / "dcp", tmp_path / "meg", "--tp", "2", code=2)
    assert "Qwen2_5_VLForConditionalGeneration" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_config_that_is_not_the_checkpoints_is_refused_by_name(
    vlm: Path, tmp_path: Path, cli
) -> None:
    """One layer more in the config: the checkpoint lacks its tensors. One layer less: the
    checkpoint holds tensors the model has no place for. Either is refused, never dropped."""
    for layers, said in ((3, "layers.2.self_attn.q_proj.weight missing"), (1, "no place")):
        source = tmp_path / f"layers{layers}"
        shutil.copytree(vlm / "dcp", source)
        config = json.loads((source / "config.json").read_text())
        text = config["text_config"]
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:1] * layers
        (source / "config.json").write_text(json.dumps(config))
        result = cli("consolidate", source, tmp_path / f"out{layers}", code=3)
        assert said in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / f"out{layers}" / "model.safetensors").exists()
    text["layer_types"] = ["full_attention"]  # a config transformers refuses: said in one line
    (source / "config.json").write_text(
        json.dumps(config | {"text_config": text | {"num_hidden_layers": 2}})
    )
    result = cli("consolidate", source, tmp_path / "bad", code=3)
    assert "layer_types" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_an_architecture_transformers_lacks_is_refused_and_no_code_is_run(
    vlm: Path, tmp_path: Path, cli
) -> None:
    source = tmp_path / "remote"
    shutil.copytree(vlm / "dcp", source)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["MyRemoteModel"]
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyRemoteModel"}
    (source / "config.json").write_text(json.dumps(config))
    result = cli("consolidate", source, tmp_path / "out", code=3)
    assert "MyRemoteModel" in result.stderr and "never runs" in result.stderr
    # A quantized config of a model ckptctl carries by name: its weights would be written as
    # stored under a config that says otherwise.
    config["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (source / "config.json").write_text(json.dumps(config))
    result = cli("consolidate", source, tmp_path / "out", code=3)
    assert "quantization_config" in result.stderr


def test_transformers5_packed_experts_become_the_hubs_per_expert_tensors(
    moe: Path, tmp_path: Path, cli
) -> None:
    """Qwen3-MoE trained under FSDP2 holds each layer's experts packed
    (``experts.gate_up_proj`` ``[E, 2F, H]``, sharded over experts): the HF output holds the
    hub's per-expert tensors, as ``save_pretrained`` writes them, bit for bit."""
    cli("consolidate", moe / "dcp", tmp_path / "hf")
    ours = _as_save_pretrained_writes(moe, tmp_path / "hf", tmp_path / "reference")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in ours
    truth = _truth(moe)
    logits = _logits(_loaded(tmp_path / "hf"), truth["input_ids"])
    # The live FSDP2 model computed its experts over sharded DTensors: the same to rounding.
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-6)


def test_transformers5_packed_experts_reshard_to_megatron_with_adam_state(
    moe: Path, tmp_path: Path, cli
) -> None:
    cli("reshard", moe / "dcp", tmp_path / "meg", "--ep", "2", "--dp", "2", "--pp", "2")
    report = cli.json("verify", tmp_path / "meg", "--against", moe / "dcp")
    assert report["ok"]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg_sq/") and "experts" in n for n in names)
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    cli("consolidate", tmp_path / "meg", tmp_path / "hf")
    cli("consolidate", moe / "dcp", tmp_path / "direct")
    assert cli.json("verify", tmp_path / "hf", "--against", tmp_path / "direct")["ok"]


def test_gemma3_under_fsdp2_reshards_to_megatron_with_adam_state(
    gemma3: Path, tmp_path: Path, cli
) -> None:
    """Gemma 3 (issue 56) trained under FSDP2 and saved as DCP: to Megatron TP2 PP2 with its Adam
    state, every tensor equal; back to HF equal to the direct conversion, whose logits are the
    live model's."""
    cli("reshard", gemma3 / "dcp", tmp_path / "meg", "--tp", "2", "--pp", "2")
    info = cli.json("inspect", tmp_path / "meg")
    assert info["hf"]["architecture"] == "Gemma3ForCausalLM" and info["has_optimizer"]
    assert info["spec"]["post_sublayer_norms"] and info["spec"]["full_attention_layers"] == [1, 3]
    report = cli.json("verify", tmp_path / "meg", "--against", gemma3 / "dcp")
    assert report["ok"]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg_sq/") and "post_layernorm" in n for n in names), names
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    cli("consolidate", tmp_path / "meg", tmp_path / "hf")
    cli("consolidate", gemma3 / "dcp", tmp_path / "direct")
    assert cli.json("verify", tmp_path / "hf", "--against", tmp_path / "direct")["ok"]
    truth = _truth(gemma3)
    logits = _logits(_loaded(tmp_path / "hf"), truth["input_ids"])
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-6)


def test_qwen35_under_fsdp2_reshards_to_megatron_with_adam_state(
    qwen35: Path, tmp_path: Path, cli
) -> None:
    """Qwen3.5 (issue 56) under FSDP2: its gated norms, stored as one plus Megatron's
    zero-centred weight, are read with the one taken off (exactly), so its DCP goes to Megatron
    TP2 PP2 with Adam's state (the moments unshifted: a gradient of ``1 + w`` is one of ``w``),
    every tensor equal, and back to HF byte-identical to the direct conversion, whose logits
    are the live model's. The second stage starts with a gated delta net's ``dt_bias`` (no
    weight decay): its parameter groups say which is which (``wd_mult``), or ckptctl could not
    read its own output back."""
    cli("consolidate", qwen35 / "dcp", tmp_path / "direct")
    truth = _truth(qwen35)
    tensors = _tensors(tmp_path / "direct")
    for name, tensor in truth["model"].items():
        assert torch.equal(tensors[name], tensor), name
    logits = _logits(_loaded(tmp_path / "direct"), truth["input_ids"])
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-6)
    cli("reshard", qwen35 / "dcp", tmp_path / "meg", "--tp", "2", "--pp", "2")
    report = cli.json("verify", tmp_path / "meg", "--against", qwen35 / "dcp")
    assert report["ok"] and report["against"]["compared"] == report["against"]["held"][1]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg/") and n.endswith("out_norm.weight") for n in names), names
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    cli("consolidate", tmp_path / "meg", tmp_path / "back")
    direct = (tmp_path / "direct" / "model.safetensors").read_bytes()
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == direct
    states = optimizer_tensors(tmp_path / "meg")
    for i in (0, 1, 2):  # the gated delta net layers' norm moments, as torch keeps them
        moments = truth["moments"][f"model.layers.{i}.linear_attn.norm.weight"]
        assert holds(states, moments["exp_avg"]) and holds(states, moments["exp_avg_sq"])


def test_gpt_oss_under_fsdp2_reshards_to_megatron_with_adam_state(
    gpt_oss: Path, tmp_path: Path, cli
) -> None:
    """GPT-OSS (issue 56) under FSDP2: its packed experts (transposed, gate and up interleaved)
    are read block by block into Megatron's experts, not only by name. To HF it is what
    ``save_pretrained`` writes, with its logits; to Megatron TP2 EP2 with Adam's state, each
    expert's moments torch's (turned, gate and up apart, found in the rank files by value),
    and back to HF byte-identical to the direct conversion."""
    cli("consolidate", gpt_oss / "dcp", tmp_path / "direct")
    _as_save_pretrained_writes(gpt_oss, tmp_path / "direct", tmp_path / "reference")
    truth = _truth(gpt_oss)
    logits = _logits(_loaded(tmp_path / "direct"), truth["input_ids"])
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-5)
    cli("reshard", gpt_oss / "dcp", tmp_path / "meg", "--tp", "2", "--ep", "2", "--etp", "1")
    cli("consolidate", tmp_path / "meg", tmp_path / "back")
    back = (tmp_path / "back" / "model.safetensors").read_bytes()
    assert back == (tmp_path / "direct" / "model.safetensors").read_bytes()
    states = optimizer_tensors(tmp_path / "meg")
    compared = 0
    for i in range(2):
        moments = truth["moments"]
        fc1 = moments[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        fc2 = moments[f"model.layers.{i}.mlp.experts.down_proj"]
        for state in ("exp_avg", "exp_avg_sq"):
            for gate_up, down in zip(fc1[state], fc2[state], strict=True):
                turned = gate_up.T  # [2F, H], gate and up rows interleaved
                wants = (torch.cat([turned[0::2], turned[1::2]]), down.T.contiguous())
                for want in wants:
                    assert holds(states, want)
                    compared += 1
                assert not holds(states, turned)
    assert compared == 2 * 2 * 4 * 2


def test_a_vlms_text_decoder_under_fsdp2_goes_to_megatron_alone_with_its_adam_state(
    gemma3_vl: Path, tmp_path: Path, cli
) -> None:
    """Gemma 3's vision-language model (issue 56) trained under FSDP2, saved as DCP in
    transformers' in-memory names: ``--text-only`` reads its text decoder alone (the vision
    tower and projector left out, counted) into Megatron TP1 PP2 with Adam's state. Back to
    HF it is ``Gemma3ForCausalLM`` holding the decoder's tensors as trained, whose logits are the
    live vision-language model's on text; the output projections' and down projections'
    moments are torch's, found in the rank files by value."""
    result = cli("reshard", gemma3_vl / "dcp", tmp_path / "meg", "--pp", "2", "--text-only")
    truth = _truth(gemma3_vl)
    outside = sum(not n.startswith(("model.language_model.", "lm_head.")) for n in truth["model"])
    assert f"{outside} tensors outside it" in result.stdout + result.stderr
    cli("consolidate", tmp_path / "meg", tmp_path / "hf")
    decoder = {
        "model." + name.removeprefix("model.language_model."): tensor
        for name, tensor in truth["model"].items()
        if name.startswith("model.language_model.")
    }
    ours = _tensors(tmp_path / "hf")
    assert sorted(ours) == sorted(decoder)  # tied: no lm_head, as the text model saves it
    for name, tensor in decoder.items():
        assert torch.equal(ours[name], tensor), name
    model = _loaded(tmp_path / "hf")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    torch.testing.assert_close(
        _logits(model, truth["input_ids"]), truth["logits"], rtol=1e-5, atol=1e-6
    )
    states = optimizer_tensors(tmp_path / "meg")
    compared = 0
    for i in range(4):
        for part in ("self_attn.o_proj", "mlp.down_proj"):
            moments = truth["moments"][f"model.language_model.layers.{i}.{part}.weight"]
            for state in ("exp_avg", "exp_avg_sq"):
                assert holds(states, moments[state])
                compared += 1
    assert compared == 4 * 2 * 2
    plain = cli("reshard", gemma3_vl / "dcp", tmp_path / "refused", "--pp", "2", code=2)
    assert "--text-only" in plain.stderr and "Traceback" not in plain.stderr
