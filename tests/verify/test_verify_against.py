"""``verify A --against B`` accounts for every tensor of both sides, for every pair of formats
ckptctl converts between: each tensor is compared or named as held by one side only (a failure
unless narrowed), and the report says how many were compared out of how many."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptctl import synth


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Megatron TP2 PP2 checkpoint with Adam state and everything ckptctl converts it to."""
    from typer.testing import CliRunner

    from ckptctl.cli.main import app

    root = tmp_path_factory.mktemp("against")
    model = synth.make_model(synth.tiny_llama_config(num_heads=8, num_kv_heads=4), seed=5)
    src = root / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=5), src, tp=2, pp=2)
    jobs = {
        "megatron-tp1-pp4": ("reshard", src, "--tp", "1", "--pp", "4"),
        "torch_dist-tp2-pp1": ("reshard", src, "--tp", "2", "--pp", "1", "--format", "torch_dist"),
        "megatron-full": ("consolidate", src, "--format", "megatron"),
        "hf": ("consolidate", src, "--format", "hf"),
        "universal": ("consolidate", src, "--format", "deepspeed-universal"),
    }
    made = {"src": src}
    runner = CliRunner()
    for name, (command, source, *flags) in jobs.items():
        result = runner.invoke(app, [command, str(source), str(root / name), *flags])
        assert result.exit_code == 0, (name, result.stderr)
        made[name] = root / name
    # One torch.save file of the torch_dist checkpoint (dcp_to_torch_save's layout).
    result = runner.invoke(
        app,
        ["consolidate", str(root / "torch_dist-tp2-pp1"), str(root / "torch"), "--format", "torch"],
    )
    assert result.exit_code == 0, result.stderr
    made["torch"] = root / "torch"
    return made


def _against(cli, a: Path, b: Path, *flags: str, code: int = 0) -> dict:
    result = cli("verify", a, "--against", b, "--json", *flags, code=code)
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", ["megatron-tp1-pp4", "torch_dist-tp2-pp1", "megatron-full"])
def test_outputs_with_optimizer_state_compare_every_tensor(outputs, cli, name: str) -> None:
    for a, b in ((outputs[name], outputs["src"]), (outputs["src"], outputs[name])):
        report = _against(cli, a, b)
        counts = report["against"]
        assert counts["compared"] == counts["held"][0] == counts["held"][1]
        assert not counts["only_here"] and not counts["only_there"]
        names = {t["name"] for t in report["tensors"]}
        assert {n.split("/")[0] for n in names if "/" in n} >= {"exp_avg", "exp_avg_sq"}
        assert all(t["equal"] for t in report["tensors"])


def test_weights_only_outputs_fail_unless_narrowed(outputs, cli) -> None:
    report = _against(cli, outputs["hf"], outputs["src"], code=1)
    counts = report["against"]
    assert counts["only_there"] and not counts["only_here"]
    assert "only in" in next(c for c in report["checks"] if c["name"] == "against")["detail"]
    narrowed = _against(cli, outputs["hf"], outputs["src"], "--weights-only")
    assert narrowed["against"]["compared"] == narrowed["against"]["held"][0]
    layer0 = _against(cli, outputs["hf"], outputs["src"], "--only", "decoder.layers.0.*")
    assert layer0["against"]["compared"] > 0
    assert all(t["name"].startswith("decoder.layers.0.") for t in layer0["tensors"])


def test_deepspeed_universal_compares_every_tensor(outputs, cli) -> None:
    report = _against(cli, outputs["universal"], outputs["src"])
    counts = report["against"]
    assert counts["compared"] == counts["held"][1] and not counts["only_here"]


def test_one_torch_file_is_placed_in_the_model_of_the_other_side(outputs, cli) -> None:
    """The reproduction of the report: a torch file holding torch_dist's keys (layer-stacked,
    ``optimizer.state.*``) against the Megatron source compared 1 of 51 tensors and passed.
    Now its keys are placed in the source's model: every weight and Adam moment is compared,
    and Adam's step, which such a file does not hold, is named as held by the source only."""
    report = _against(cli, outputs["torch"], outputs["src"], code=1)
    counts = report["against"]
    assert counts["naming"] == "placed"
    assert counts["compared"] >= 4 * 51 - 51  # weights, masters and both moments
    assert counts["only_there"] and all(n.startswith("step/") for n in counts["only_there"])
    narrowed = _against(cli, outputs["torch"], outputs["src"], "--only", "[!s]*")
    assert narrowed["ok"] and narrowed["against"]["compared"] == counts["compared"]
    assert all(t["equal"] for t in narrowed["tensors"])


def test_a_tensor_missing_on_one_side_is_named(outputs, cli, tmp_path: Path) -> None:
    state = torch.load(outputs["torch"] / "state_dict.pt", weights_only=False)
    del state["optimizer.state.exp_avg.output_layer.weight"]
    state["decoder.final_layernorm.weight"] = state["decoder.final_layernorm.weight"].clone()
    state["decoder.final_layernorm.weight"][0] += 1
    (tmp_path / "t").mkdir()
    torch.save(state, tmp_path / "t" / "state_dict.pt")
    report = _against(cli, tmp_path / "t", outputs["src"], "--only", "[!s]*", code=1)
    assert "exp_avg/output_layer.weight" in report["against"]["only_there"]
    differ = [t["name"] for t in report["tensors"] if not t["equal"]]
    assert differ == ["decoder.final_layernorm.weight"]


def test_a_tensor_of_another_shape_is_not_compared_in_part(outputs, cli, tmp_path: Path) -> None:
    """A stored tensor larger than the model's is never clipped to fit and passed."""
    state = torch.load(outputs["torch"] / "state_dict.pt", weights_only=False)
    norm = state["decoder.final_layernorm.weight"]
    state["decoder.final_layernorm.weight"] = torch.cat([norm, norm])
    (tmp_path / "t").mkdir()
    torch.save(state, tmp_path / "t" / "state_dict.pt")
    report = _against(cli, tmp_path / "t", outputs["src"], "--only", "[!s]*", code=1)
    (norm,) = [t for t in report["tensors"] if t["name"] == "decoder.final_layernorm.weight"]
    assert not norm["equal"] and "shape [128] here, [64] there" in norm["problem"]


def test_two_checkpoints_of_unknown_models_compare_by_stored_name(outputs, cli, tmp_path) -> None:
    state = torch.load(outputs["torch"] / "state_dict.pt", weights_only=False)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    torch.save(
        {"x": state["decoder.final_layernorm.weight"], "y": torch.ones(3)},
        tmp_path / "a" / "state_dict.pt",
    )
    torch.save({"x": state["decoder.final_layernorm.weight"]}, tmp_path / "b" / "state_dict.pt")
    report = _against(cli, tmp_path / "a", tmp_path / "b", code=1)
    assert report["against"]["naming"] == "stored"
    assert report["against"]["only_here"] == ["y"] and report["against"]["compared"] == 1
    assert _against(cli, tmp_path / "a", tmp_path / "b", "--only", "x")["ok"]


def test_narrowing_needs_against(outputs, cli) -> None:
    result = cli("verify", outputs["hf"], "--weights-only", code=2)
    assert "--against" in result.stderr


def test_megatrons_vocabulary_padding_rows_are_compared(cli, tmp_path: Path) -> None:
    """Megatron's padding rows (1100 -> 1152) are trained state outside the model's tensors:
    equal ones are counted, and a change to them alone fails the comparison by name."""
    import shutil

    model = synth.make_model(synth.tiny_llama_config(), seed=3)
    src = tmp_path / "src"
    synth.write_megatron(
        model, synth.adam_step(model, seed=3), src, dp=2, distributed_optimizer=True
    )
    plain = tmp_path / "plain"
    cli("reshard", src, plain, "--dp", "1", "--no-distributed-optimizer")
    report = _against(cli, plain, src)
    assert report["ok"], report
    detail = next(c for c in report["checks"] if c["name"] == "against")["detail"]
    assert "padding rows (1100..1151) equal in 8 tensors" in detail, detail
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    rank_file = next(changed.rglob("model_optim_rng.pt"))
    state = torch.load(rank_file, weights_only=False)
    weight = state["model"]["output_layer.weight"]
    assert weight.shape[0] == 1152
    weight[1100:] = 1.0
    torch.save(state, rank_file)
    report = _against(cli, changed, src, code=1)
    detail = next(c for c in report["checks"] if c["name"] == "against")["detail"]
    assert " differ from " not in detail and "padding rows (1100..1151)" in detail, detail
    assert "differ in 1 of 8 tensors" in detail, detail
    assert "(output_layer.weight)" in detail, detail
