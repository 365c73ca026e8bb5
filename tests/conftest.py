"""Shared fixtures: run the CLI in-process and read back what it wrote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from ckptctl.cli.main import app


class Cli:
    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: str, code: int = 0) -> Any:
        result = self.runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == code, (
            f"ckptctl {' '.join(map(str, args))} exited {result.exit_code}, wanted {code}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}\n{result.exception!r}"
        )
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "--json").stdout)


@pytest.fixture(autouse=True)
def _isolated_profiles(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """Calibrated storage profiles go to a per-test home, never the user's."""
    monkeypatch.setenv("CKPTCTL_HOME", str(tmp_path_factory.mktemp("ckptctl-home")))


@pytest.fixture
def cli() -> Cli:
    return Cli()


@pytest.fixture(scope="module")
def mcli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    """The in-process CLI for module-scoped fixtures, with its own CKPTCTL_HOME (the autouse
    per-test isolation above does not reach module scope)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CKPTCTL_HOME", str(tmp_path_factory.mktemp("ckptctl-home")))
        yield Cli()
