"""Format options live with the formats that read them (``CheckpointFormat.options``): the CLI
gives every declared flag; a flag the checkpoint's format does not read is refused by name,
since it would change nothing; a job of several sources takes one that any of them reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptctl import synth
from ckptctl.formats import registry


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = synth.make_model(synth.tiny_llama_config(), seed=3)
    out = tmp_path_factory.mktemp("options") / "megatron"
    synth.write_megatron(model, synth.adam_step(model, seed=3), out, tp=2, pp=1)
    return out


@pytest.fixture(scope="module")
def hf(megatron: Path, mcli) -> Path:
    out = megatron.parent / "hf"
    mcli("consolidate", megatron, out)
    return out


def _help(cli, command: str) -> str:
    from ckptctl.cli.main import app

    result = cli.runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    return result.stdout


@pytest.mark.parametrize("fmt", registry.formats(), ids=lambda f: f.name)
def test_every_declared_option_is_a_flag_of_the_commands_that_read(cli, fmt) -> None:
    for command in ("inspect", "consolidate", "reshard"):
        text = _help(cli, command)
        for option in fmt.options:
            assert option.flag in text, (command, option.flag)


def test_an_option_the_format_does_not_read_is_refused_by_its_flag(
    cli, megatron: Path, hf: Path
) -> None:
    result = cli("inspect", megatron, "--hf-config", hf / "config.json", code=2)
    assert "--hf-config gives the HF config.json" in result.stderr
    assert "but this is a megatron checkpoint" in result.stderr
    result = cli("inspect", hf, "--iteration", "1", code=2)
    assert "--iteration names a Megatron iteration directory" in result.stderr
    assert "but this is a hf checkpoint" in result.stderr
    result = cli("consolidate", hf, megatron.parent / "out", "--true-vocab-size", "100", code=2)
    assert "--true-vocab-size" in result.stderr and "hf checkpoint" in result.stderr
    assert not (megatron.parent / "out").exists()
    doc = json.loads(cli("inspect", hf, "--iteration", "1", "--json", code=2).stdout)
    assert doc["exit_code"] == 2 and "--iteration" in doc["error"]
    # Options the format reads, and --trust-field (an adapter may read it), are taken.
    assert cli.json("inspect", megatron, "--iteration", "1")["format"] == "megatron"
    assert cli.json("inspect", hf, "--hf-config", hf / "config.json")["format"] == "hf"
    assert cli.json("inspect", hf, "--trust-field", "some_field")["format"] == "hf"


def test_a_job_of_two_sources_takes_an_option_either_reads(cli, megatron: Path, hf: Path) -> None:
    config = hf / "config.json"
    summary = cli.json("verify", megatron, "--against", hf, "--weights-only", "--hf-config", config)
    assert summary["ok"], summary
    result = cli("verify", megatron, "--against", megatron, "--hf-config", config, code=2)
    assert "no source of the job reads it" in result.stderr
    assert f"{megatron} is megatron" in result.stderr


def test_every_option_a_job_gives_is_one_some_format_reads() -> None:
    """The names the pipeline gives options under are the names formats declare them by (a
    misspelt one would be neither read nor refused)."""
    from ckptctl.pipeline.probe import given_options
    from ckptctl.settings import Settings

    every = Settings(
        hf_config={"model_type": "llama"},
        trusted_fields=frozenset({"field"}),
        tag="global_step1",
        text_only=True,
        allow_rounding=True,
    )
    given = given_options(every, iteration=1, true_vocab_size=100)
    declared = {o.name for f in registry.formats() for o in f.options}
    assert set(given) == declared
    assert all(registry.option(name) is not None for name in given)
