"""The oracle-run cache keeps a run only for exactly what decided it: the same command on the
same inputs restores what the run wrote; a changed input, or another command, runs again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import oracle_cache


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oracle_cache, "CACHE", tmp_path / "cache")
    monkeypatch.delenv("CKPTCTL_ORACLE_CACHE", raising=False)


def _session(root: Path, text: str, extra: str = "") -> tuple[list[str], bool]:
    """One session's run in its own folder: an input ``text``, a command naming it; what the
    run (a copy of the input, reversed) left, and whether it was restored."""
    folder = root / "run"
    folder.mkdir(parents=True)
    (folder / "input.txt").write_text(text)
    calls: list[str] = []

    def run() -> None:
        calls.append("ran")
        (folder / "out").mkdir()
        (folder / "out" / "result.txt").write_text(text[::-1])

    command = ["oracle", str(folder / "input.txt"), str(folder / "out"), extra]
    restored = oracle_cache.run_once(folder, oracle_cache.key(folder, command, "env"), run)
    assert restored == (not calls)
    return [(folder / "out" / "result.txt").read_text()], restored


def test_the_same_run_is_restored_and_a_changed_input_runs_again(tmp_path: Path) -> None:
    assert _session(tmp_path / "a", "abc") == (["cba"], False)
    assert _session(tmp_path / "b", "abc") == (["cba"], True)  # another folder, same inputs
    assert _session(tmp_path / "c", "abd") == (["dba"], False)
    assert _session(tmp_path / "d", "abc", "--more") == (["cba"], False)
