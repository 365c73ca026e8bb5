"""Reshard proven by round trips (A -> B -> A reproduces every tensor of every file, optimizer
state included), chains ending in transformers, and full -> sharded cuts."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl import synth
from ckptctl.model.layout import ParallelLayout

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 1100, (2, 17), generator=torch.Generator().manual_seed(3))
LAYERS = 8


def _model(tied: bool) -> tuple[Any, Any]:
    config = synth.tiny_llama_config(num_heads=8, num_kv_heads=4, tie_word_embeddings=tied)
    model = synth.make_model(config, seed=5)
    return model, synth.adam_step(model, seed=6)


MODELS = {tied: _model(tied) for tied in (False, True)}


@st.composite
def layouts(draw: st.DrawFn) -> ParallelLayout:
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 4]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    first = last = None
    if pp > 2 and vpp == 1 and draw(st.booleans()):
        first = last = 1  # 1 + 6 over the middle stages + 1
        if (LAYERS - 2) % (pp - 2):
            first = last = None
    return ParallelLayout(tp=tp, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)


def _layout_flags(layout: ParallelLayout) -> list[str]:
    flags = ["--tp", str(layout.tp), "--pp", str(layout.pp), "--vpp", str(layout.vpp)]
    if layout.first_stage_layers is not None:
        flags += ["--pp-first-stage-layers", str(layout.first_stage_layers)]
    if layout.last_stage_layers is not None:
        flags += ["--pp-last-stage-layers", str(layout.last_stage_layers)]
    if layout.first_stage_layers is None and layout.last_stage_layers is None:
        flags.append("--even-stages")  # else a reshard keeps the source's split
    return flags


def _write(root: Path, layout: ParallelLayout, tied: bool, dtype: torch.dtype) -> None:
    model, states = MODELS[tied]
    synth.write_megatron(
        model,
        states,
        root,
        tp=layout.tp,
        pp=layout.pp,
        vpp=layout.vpp,
        first_stage_layers=layout.first_stage_layers,
        last_stage_layers=layout.last_stage_layers,
        params_dtype=dtype,
    )


def _assert_tree_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            _assert_tree_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_tree_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Every file, every tensor and all training state equal; RNG state is dropped where the
    TP/PP/EP grid changes (it belongs to a rank's place in it)."""
    files_a = sorted(p.relative_to(a) for p in a.rglob("*.pt"))
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*.pt"))
    assert (a / "latest_checkpointed_iteration.txt").read_text() == (
        b / "latest_checkpointed_iteration.txt"
    ).read_text()
    for rel in files_a:
        x = torch.load(a / rel, weights_only=False)
        y = torch.load(b / rel, weights_only=False)
        x.pop("rng_state", None)
        y.pop("rng_state", None)  # kept by a direct copy, dropped by a reshard
        if "args" not in x:  # distrib_optim.pt
            _assert_tree_equal(x, y, str(rel))
            continue
        args_x, args_y = x.pop("args"), y.pop("args")
        _assert_tree_equal(x, y, str(rel))
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "padded_vocab_size",
            "num_layers",
        ):
            assert getattr(args_x, key) == getattr(args_y, key), (rel, key)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(a=layouts(), b=layouts(), tied=st.booleans(), bf16=st.booleans())
def test_round_trip_is_bit_exact(tmp_path_factory, cli, a, b, tied, bf16) -> None:
    root = tmp_path_factory.mktemp("rt")
    _write(root / "a", a, tied, torch.bfloat16 if bf16 else torch.float32)
    if a == b:  # a reshard with nothing to change writes nothing
        assert (
            "nothing to change" in cli("reshard", root / "a", root / "b", *_layout_flags(b)).stdout
        )
        assert not (root / "b").exists()
        return
    cli("reshard", root / "a", root / "b", *_layout_flags(b))
    cli("reshard", root / "b", root / "a2", *_layout_flags(a))
    assert_same_checkpoint(root / "a", root / "a2")
    shutil.rmtree(root)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(a=layouts(), b=layouts(), tied=st.booleans(), bf16=st.booleans())
def test_round_trip_is_bit_exact_many(tmp_path_factory, cli, a, b, tied, bf16) -> None:
    test_round_trip_is_bit_exact.hypothesis.inner_test(tmp_path_factory, cli, a, b, tied, bf16)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chain_of_reshards_then_hf_gives_bitwise_logits(tmp_path: Path, cli, tied: bool) -> None:
    model, _ = MODELS[tied]
    _write(tmp_path / "0", ParallelLayout(tp=2, pp=2), tied, torch.float32)
    chain = [
        ParallelLayout(tp=4, pp=1),
        ParallelLayout(tp=1, pp=4, vpp=2),
        ParallelLayout(tp=2, pp=4, first_stage_layers=1, last_stage_layers=1),
    ]
    for i, layout in enumerate(chain, start=1):
        cli("reshard", tmp_path / str(i - 1), tmp_path / str(i), *_layout_flags(layout))
    cli("consolidate", tmp_path / str(len(chain)), tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


def test_full_megatron_to_sharded_equals_direct_write(tmp_path: Path, cli) -> None:
    _write(tmp_path / "full", ParallelLayout(), False, torch.bfloat16)
    target = ParallelLayout(tp=4, pp=2, vpp=2)
    _write(tmp_path / "direct", target, False, torch.bfloat16)
    summary = cli.json("reshard", tmp_path / "full", tmp_path / "cut", *_layout_flags(target))
    assert summary["bytes_written"] > 0 and summary["peak_rss_bytes"] > 0
    assert_same_checkpoint(tmp_path / "direct", tmp_path / "cut")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_to_sharded_weights_equal_direct_write(tmp_path: Path, cli, tied: bool) -> None:
    model, states = MODELS[tied]
    synth.save_hf(model, str(tmp_path / "hf"))
    target = ParallelLayout(tp=2, pp=4)
    synth.write_megatron(model, states, tmp_path / "direct", tp=2, pp=4, with_optimizer=False)
    result = cli("reshard", tmp_path / "hf", tmp_path / "cut", *_layout_flags(target))
    assert "no optimizer state" in result.stderr
    # An HF model has no iteration: the cut is a "release" checkpoint, as Megatron names it.
    assert (tmp_path / "cut/latest_checkpointed_iteration.txt").read_text() == "release"
    direct = tmp_path / "direct/iter_0000001"
    for rel in sorted(p.relative_to(direct) for p in direct.rglob("*.pt")):
        want = torch.load(direct / rel, weights_only=False)["model"]
        got = torch.load(tmp_path / "cut/release" / rel, weights_only=False)["model"]
        _assert_tree_equal(got, want, str(rel))
    cli("consolidate", tmp_path / "cut", tmp_path / "back")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


def test_small_memory_budget_streams_in_bands(tmp_path: Path, cli) -> None:
    _write(tmp_path / "a", ParallelLayout(tp=2, pp=2), False, torch.float32)
    cli("reshard", tmp_path / "a", tmp_path / "b", "--tp", "4", "--memory-budget", "4KiB")
    cli("reshard", tmp_path / "b", tmp_path / "a2", "--tp", "2", "--pp", "2")
    assert_same_checkpoint(tmp_path / "a", tmp_path / "a2")


def test_tp_not_dividing_query_groups_is_refused(tmp_path: Path, cli) -> None:
    _write(tmp_path / "a", ParallelLayout(tp=2), False, torch.float32)
    result = cli("reshard", tmp_path / "a", tmp_path / "b", "--tp", "8", code=2)
    assert "tp=8 does not divide num_query_groups=4" in result.stderr
    assert not (tmp_path / "b" / "latest_checkpointed_iteration.txt").exists()


def test_parallel_reads_give_the_same_bytes(tmp_path: Path, cli) -> None:
    from ckptctl.io.storage import Storage
    from ckptctl.pipeline.execute import execute
    from ckptctl.pipeline.jobs import plan_reshard

    _write(tmp_path / "a", ParallelLayout(tp=2, pp=2), False, torch.float32)
    wanted = {"tp": 4, "pp": 1, "vpp": 1}
    job = plan_reshard(str(tmp_path / "a"), str(tmp_path / "par"), wanted)
    execute(
        job.plan,
        job.sources,
        Storage(str(tmp_path / "par")),
        workers=4,
        memory_budget=64 << 10,
    )
    cli("reshard", tmp_path / "a", tmp_path / "seq", "--tp", "4", "--pp", "1")
    assert_same_checkpoint(tmp_path / "seq", tmp_path / "par")
