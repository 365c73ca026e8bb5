"""Consolidation proven against transformers and against an independently written TP1 file.

HF model -> Megatron(layout) by the independent example generator -> ``ckptctl consolidate``:
every HF parameter must be ``torch.equal`` to the original and the logits bitwise equal; the
Megatron TP1 PP1 output must equal, tensor for tensor (optimizer state included), what the
generator writes for TP1 PP1 directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl import synth

transformers = pytest.importorskip("transformers")

LAYOUTS = [
    # (tp, pp, vpp)
    (1, 1, 1),
    (2, 1, 1),
    (4, 1, 1),
    (1, 2, 1),
    (1, 4, 1),
    (2, 2, 1),
    (2, 2, 2),
    (1, 4, 2),
    (4, 2, 1),
]
IDS = torch.randint(0, 1100, (2, 17), generator=torch.Generator().manual_seed(7))


def _model(tied: bool) -> tuple[Any, Any]:
    config = synth.tiny_llama_config(num_heads=8, num_kv_heads=4, tie_word_embeddings=tied)
    model = synth.make_model(config, seed=1)
    states = synth.adam_step(model, seed=2)
    return model, states


@pytest.fixture(scope="module")
def models() -> dict[bool, tuple[Any, Any]]:
    return {tied: _model(tied) for tied in (False, True)}


def _from_pretrained(path: Path, dtype: torch.dtype) -> Any:
    # Same attention kernel as the generator's model, so logits can be compared bitwise.
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    )


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    ("tp", "pp", "vpp"), LAYOUTS, ids=[f"tp{t}pp{p}vpp{v}" for t, p, v in LAYOUTS]
)
def test_consolidate_to_hf_equals_original(models, tmp_path: Path, cli, tp, pp, vpp, tied) -> None:
    model, states = models[tied]
    src = tmp_path / "megatron"
    synth.write_megatron(model, states, src, tp=tp, pp=pp, vpp=vpp)
    out = tmp_path / "hf"
    summary = cli.json("consolidate", src, out, "--format", "hf")
    assert summary["bytes_written"] > 0
    loaded = _from_pretrained(out, torch.float32)
    original = model.state_dict()
    restored = loaded.state_dict()
    assert set(restored) == set(original)
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    ("tp", "pp", "vpp", "dtype"),
    [(2, 2, 1, torch.float32), (2, 2, 2, torch.bfloat16), (4, 1, 1, torch.bfloat16)],
)
def test_consolidate_to_megatron_keeps_optimizer_bit_exact(
    models, tmp_path: Path, cli, tp, pp, vpp, dtype, tied
) -> None:
    model, states = models[tied]
    src, direct, out = tmp_path / "src", tmp_path / "direct", tmp_path / "out"
    synth.write_megatron(model, states, src, tp=tp, pp=pp, vpp=vpp, params_dtype=dtype)
    synth.write_megatron(model, states, direct, tp=1, pp=1, params_dtype=dtype)
    cli("consolidate", src, out, "--format", "megatron")
    rel = "iter_0000001/mp_rank_00/model_optim_rng.pt"
    got, want = _load(out / rel), _load(direct / rel)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert list(got["model"]) == list(want["model"])
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    want_opt, got_opt = want["optimizer"], got["optimizer"]
    # Mixed precision nests the torch state dict under "optimizer"; FP32Optimizer stores it bare.
    want_torch = want_opt["optimizer"] if dtype != torch.float32 else want_opt
    got_torch = got_opt["optimizer"] if dtype != torch.float32 else got_opt
    assert got_torch["param_groups"] == want_torch["param_groups"]
    assert got_torch["state"].keys() == want_torch["state"].keys()
    for index, state in want_torch["state"].items():
        assert list(got_torch["state"][index]) == list(state)
        for key, tensor in state.items():
            assert torch.equal(got_torch["state"][index][key], tensor), (index, key)
    if dtype != torch.float32:
        for g_got, g_want in zip(
            got_opt["fp32_from_fp16_params"], want_opt["fp32_from_fp16_params"], strict=True
        ):
            assert all(torch.equal(a, b) for a, b in zip(g_got, g_want, strict=True))
    assert got["opt_param_scheduler"] == want["opt_param_scheduler"]
    assert got["iteration"] == want["iteration"]
    assert "rng_state" not in got
    assert got["args"].tensor_model_parallel_size == 1
    assert got["args"].pipeline_model_parallel_size == 1
    assert got["args"].padded_vocab_size == want["args"].padded_vocab_size


def test_dtype_conversion_and_sharded_hf_index(models, tmp_path: Path, cli) -> None:
    model, states = models[False]
    src, out = tmp_path / "src", tmp_path / "hf"
    synth.write_megatron(model, states, src, tp=2, pp=2)
    cli("consolidate", src, out, "--dtype", "bf16", "--max-shard-size", "100KB")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    loaded = _from_pretrained(out, torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_local_spec_names_consolidate(models, tmp_path: Path, cli) -> None:
    model, states = models[False]
    src, out = tmp_path / "src", tmp_path / "hf"
    synth.write_megatron(model, states, src, tp=2, pp=2, naming="local")
    cli("consolidate", src, out)
    loaded = _from_pretrained(out, torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


def test_megatron_core_016_group_order_is_recognised(models, tmp_path: Path, cli) -> None:
    """Megatron-Core 0.16 puts the weight-decay group first; a later stage whose first
    parameter is a norm then numbers its state differently. Both orders must map exactly."""
    model, states = models[False]
    src, direct, out = tmp_path / "src", tmp_path / "direct", tmp_path / "out"
    kwargs = {"naming": "local", "param_group_order": "wd_first"}
    synth.write_megatron(model, states, src, tp=2, pp=2, **kwargs)
    synth.write_megatron(model, states, direct, tp=1, pp=1, **kwargs)
    cli("consolidate", src, out, "--format", "megatron")
    rel = "iter_0000001/mp_rank_00/model_optim_rng.pt"
    got, want = _load(out / rel)["optimizer"], _load(direct / rel)["optimizer"]
    assert got["param_groups"] == want["param_groups"]
    for index, state in want["state"].items():
        for key, tensor in state.items():
            assert torch.equal(got["state"][index][key], tensor), (index, key)
