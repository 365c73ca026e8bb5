"""Shared fixtures: run the CLI in-process and read back what it wrote."""

from __future__ import annotations

import json
import shutil
from collections.abc import Generator, Iterator
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


_MODULE_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator:
    report = yield
    module = item.getparent(pytest.Module)
    if report.failed and module is not None:
        module.stash[_MODULE_FAILED] = True
    return report


@pytest.fixture(scope="module", autouse=True)
def _module_directories_removed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """The checkpoints a module's fixtures wrote go when the module has passed (pytest removes a
    passing test's own tmp_path; module fixtures' directories would otherwise stay for the whole
    run, tens of GB). Kept: a failing module's, for a look, and ``shared-*`` ones that later
    modules reuse (tests/deepspeed_runs.py)."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.node.stash.get(_MODULE_FAILED, False):
        return
    for path in set(base.iterdir()) - before:
        if not path.name.startswith("shared-"):
            shutil.rmtree(path, ignore_errors=True)


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
