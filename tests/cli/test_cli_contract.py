"""What the CLI says is true: help lists what each command accepts, global options are taken
after the command too, a bad flag is one line, informational messages are notes (warnings
only for what may be wrong), long commands show progress, the demo checks its flags before it
writes anything, and nothing the user did not give changes in a reshard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptctl import synth


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = synth.make_model(synth.tiny_llama_config(num_heads=8, num_kv_heads=4), seed=8)
    out = tmp_path_factory.mktemp("contract") / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=8), out, tp=2, pp=2, vpp=2)
    return out


def _help(cli, *command: str) -> str:
    from ckptctl.cli.main import app

    result = cli.runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    return result.stdout


@pytest.mark.parametrize(
    ("command", "formats"),
    [
        ("consolidate", "<hf|deepspeed-universal|megatron|torch>"),
        ("reshard", "<megatron|torch_dist|verl>"),
        ("plan", "<megatron|torch_dist|verl>"),
    ],
)
def test_help_lists_the_formats_each_command_writes(cli, command: str, formats: str) -> None:
    text = _help(cli, command)
    assert f"--format {formats}" in text
    assert "<bool>" not in text  # flags take no value
    assert all(len(line) <= 80 for line in text.splitlines())


def test_help_of_workers_and_plan_dry_run(cli) -> None:
    assert "manifest" not in _help(cli, "verify").split("--workers", 1)[1].split("--", 1)[0]
    assert "--dry-run" not in _help(cli, "plan")
    for command in ("consolidate", "reshard", "verify", "inspect", "plan", "demo"):
        assert "--debug" in _help(cli, command)  # the global options, declared by each


def test_a_bad_flag_is_one_line(cli, source: Path) -> None:
    for argv in (["inspect", source, "--bogus"], ["demo", "--tp", "0"], ["inspect"]):
        result = cli(*argv, code=2)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stderr.startswith("error:") and "--help" in result.stderr
    doc = json.loads(cli("inspect", source, "--bogus", "--json", code=2).stdout)
    assert doc["exit_code"] == 2 and "--bogus" in doc["error"]


def test_global_options_after_the_command(cli, source: Path, tmp_path: Path) -> None:
    cli("inspect", source, "--trust-field", "some_field", "--debug")
    result = cli("inspect", source, "--tag", "global_step1", code=2)
    assert "--tag names a DeepSpeed tag directory" in result.stderr
    result = cli("inspect", source, "--part-size", "1", code=2)
    assert "--part-size 1" in result.stderr


def test_notes_and_warnings(cli, source: Path, tmp_path: Path) -> None:
    result = cli("consolidate", source, tmp_path / "hf")
    assert "note: HF safetensors hold weights only" in result.stderr
    assert "warning:" not in result.stderr
    result = cli("reshard", source, tmp_path / "tp1", "--tp", "1")
    assert "warning: RNG state belongs to each rank" in result.stderr
    assert "note: vocabulary padding recomputed" in result.stderr


def test_progress_of_long_commands(cli, source: Path, tmp_path: Path) -> None:
    assert "compress ->" in cli("compress", source, tmp_path / "z").stderr
    assert "decompress ->" in cli("decompress", tmp_path / "z", tmp_path / "back").stderr
    result = cli("verify", tmp_path / "back", "--numerics", "--against", source)
    assert "verify " in result.stderr and "NaN/Inf scan" in result.stderr
    assert "compare" in result.stderr
    assert "━" not in cli("verify", tmp_path / "back", "--json").stderr  # --json: no bar


def test_memory_budget_must_be_a_budget(cli, source: Path, tmp_path: Path) -> None:
    result = cli("consolidate", source, tmp_path / "o", "--memory-budget", "1", code=2)
    assert "--memory-budget 1 bytes is less than one row of" in result.stderr
    assert not (tmp_path / "o").exists()


def test_the_demo_checks_its_flags_before_writing(cli, tmp_path: Path) -> None:
    result = cli("demo", "--tp", "3", "--out", tmp_path / "d", code=2)
    assert "tp=3 does not divide num_query_groups=8" in result.stderr
    assert not (tmp_path / "d").exists()
    result = cli("demo", "--size", "20GB", "--out", tmp_path / "d", code=2)
    assert "--size 20GB" in result.stderr and not (tmp_path / "d").exists()


def test_demo_sizes() -> None:
    from ckptctl.cli.demo import demo_config, demo_size

    for size, low, high in (("100MB", 60e6, 160e6), ("2GB", 1.4e9, 2.8e9)):
        config = demo_config(**demo_size(size))
        h, f, v, layers = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
            config.num_hidden_layers,
        )
        kv = config.num_key_value_heads * config.head_dim
        params = 2 * v * h + layers * (2 * h * h + 2 * h * kv + 3 * h * f)
        assert low <= 12 * params <= high, (size, 12 * params)
        assert config.num_key_value_heads == 8 and f % 8 == 0 and h % 128 == 0


def test_the_demo_runs_at_tp4(cli, tmp_path: Path) -> None:
    result = cli("demo", "--tp", "4", "--pp", "1", "--out", tmp_path / "d")
    assert "bit-exact" in result.stdout and "identical" in result.stdout


def test_reshard_keeps_what_is_not_given(cli, source: Path, tmp_path: Path) -> None:
    """The source is TP2 PP2 VPP2: a reshard to TP1 keeps PP2 VPP2 and the legacy format; a
    torch_dist output stays torch_dist; nothing to change writes nothing."""
    report = cli.json("reshard", source, tmp_path / "tp1", "--tp", "1")
    assert report["target_layout"]["pp"] == 2 and report["target_layout"]["vpp"] == 2
    assert report["target_format"] == "megatron"
    result = cli("reshard", source, tmp_path / "same")
    assert "nothing to change" in result.stdout and not (tmp_path / "same").exists()
    dist = cli.json("reshard", source, tmp_path / "td", "--pp", "1", "--format", "torch_dist")
    assert dist["target_layout"]["vpp"] == 1  # VPP needs PP > 1: a note says so
    assert any("virtual pipeline: none" in n for n in dist["notes"])
    again = cli.json("reshard", tmp_path / "td", tmp_path / "td2", "--tp", "1")
    assert again["target_format"] == "torch_dist" and again["target_layout"]["tp"] == 1
    summary = cli("reshard", tmp_path / "td", tmp_path / "td3", "--pp", "2").stdout
    assert "torch_dist TP2 PP2 DP1" in summary and "changed: PP 1 -> 2" in summary


def test_a_saved_plan_runs_as_made(cli, source: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    cli("plan", source, "--tp", "1", "--pp", "4", "--out", plan)  # made without a destination
    result = cli("reshard", source, tmp_path / "x", "--plan", plan, "--tp", "2", code=2)
    assert "--tp 2 (the plan: 1)" in result.stderr
    result = cli(
        "reshard", source, tmp_path / "x", "--plan", plan, "--format", "torch_dist", code=2
    )
    assert "--format torch_dist (the plan: megatron)" in result.stderr
    cli("reshard", source, tmp_path / "x", "--plan", plan, "--tp", "1")  # agrees: runs
    assert cli.json("verify", tmp_path / "x", "--against", source)["ok"]
