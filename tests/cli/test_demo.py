"""The Quickstart's main job: ``ckptctl demo`` runs end to end and checks itself."""

from __future__ import annotations

from pathlib import Path


def test_demo_runs_and_verifies(tmp_path: Path, cli) -> None:
    result = cli("demo", "--out", tmp_path / "demo")
    assert "weights and logits identical" in result.stdout
    assert "bit-exact" in result.stdout
    assert (tmp_path / "demo/hf/config.json").exists()
    assert f"everything is in {tmp_path / 'demo'}" in result.stdout
