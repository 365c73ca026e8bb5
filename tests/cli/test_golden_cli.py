"""The CLI's JSON documents for a fixed checkpoint, against golden files: a restructuring must
not change what users' scripts read (fields that name paths, times or file identities vary by
run and are left out). ``CKPTCTL_UPDATE_GOLDEN=1 pytest tests/cli/test_golden_cli.py`` rewrites
them after a deliberate change."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptctl import synth
from ckptctl.io import storage

GOLDEN = Path(__file__).parent / "golden"
VARYING = {
    "url",
    "source_url",
    "target_url",
    "source",
    "target",
    "source_fingerprint",
    "plan_fingerprint",
    "source_identities",
    "seconds",
    "peak_rss_bytes",
    "throughput_bytes_per_s",
}


def _stable(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _stable(v) for k, v in doc.items() if k not in VARYING}
    if isinstance(doc, list):
        return [_stable(v) for v in doc]
    return doc


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = synth.make_model(synth.tiny_llama_config(), seed=0)
    out = tmp_path_factory.mktemp("golden") / "ck"
    synth.write_megatron(model, synth.adam_step(model, seed=0), out, tp=2, pp=2)
    return out


CASES = {
    "inspect": ["inspect", "{ck}"],
    "plan": ["plan", "{ck}", "{tmp}/out", "--tp", "1", "--pp", "4"],
    "consolidate_dry_run": ["consolidate", "{ck}", "{tmp}/hf", "--dry-run"],
    "reshard": ["reshard", "{ck}", "{tmp}/tp1", "--tp", "1", "--pp", "4"],
    "verify": ["verify", "{ck}"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_json_documents_match_the_golden_files(
    name: str, demo_ckpt: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # How unchanged runs move depends on the file system (``ckptctl.io.filesystems``): the
    # documents are those of the kernel copy, wherever the tests run.
    monkeypatch.setattr(storage, "kernel_copy_pays", lambda fd: True)
    ck = tmp_path / "ck"
    shutil.copytree(demo_ckpt, ck)
    args = [a.format(ck=ck, tmp=tmp_path) for a in CASES[name]]
    doc = _stable(cli.json(*args))
    path = GOLDEN / f"{name}.json"
    if os.environ.get("CKPTCTL_UPDATE_GOLDEN"):
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    assert doc == json.loads(path.read_text())


def test_a_dry_run_says_both_sides_in_full(demo_ckpt: Path, tmp_path: Path, cli) -> None:
    """``--dry-run`` says what the summary of the run would: the source and the whole target
    (format, layout, optimizer state, what changed), and writes nothing."""
    out = cli("reshard", demo_ckpt, tmp_path / "tp1", "--tp", "1", "--pp", "4", "--dry-run")
    lines = out.stdout.splitlines()
    assert "from: megatron TP2 PP2 DP1" in lines
    assert "to: megatron TP1 PP4 DP1, with optimizer state; changed: TP 2 -> 1, PP 2 -> 4" in (
        lines
    )
    out = cli("consolidate", demo_ckpt, tmp_path / "hf", "--dry-run")
    assert "to: hf safetensors, weights only" in out.stdout.splitlines()
    assert not (tmp_path / "tp1").exists() and not (tmp_path / "hf").exists()
