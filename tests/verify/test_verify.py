"""``ckptctl verify`` and the completion marker: a finished ckptctl output verifies, damage is
found and named, an interrupted one is refused by readers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptctl import synth


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = synth.make_model(synth.tiny_llama_config(num_heads=8, num_kv_heads=4), seed=2)
    out = tmp_path_factory.mktemp("verify") / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=2), out, tp=2, pp=2)
    return out


def _statuses(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def test_ckptctl_output_verifies_with_manifest(source: Path, tmp_path: Path, cli) -> None:
    cli("reshard", source, tmp_path / "out", "--tp", "4", "--pp", "1")
    manifest = json.loads((tmp_path / "out/ckptctl.manifest.json").read_text())
    assert manifest["layout"]["tp"] == 4 and manifest["checksum"] == "xxh3_64"
    assert "iter_0000001/mp_rank_03/model_optim_rng.pt" in manifest["files"]
    assert manifest["tensors"]["iter_0000001/mp_rank_03/model_optim_rng.pt"]
    assert not (tmp_path / "out/ckptctl.incomplete").exists()
    report = cli.json("verify", tmp_path / "out", "--numerics")
    assert report["ok"] and set(_statuses(report).values()) == {"passed"}


def test_foreign_checkpoint_runs_the_checks_that_apply(source: Path, cli) -> None:
    report = cli.json("verify", source)
    statuses = _statuses(report)
    assert statuses["manifest"] == "skipped" and statuses["structure"] == "passed"
    assert statuses["coverage"] == "passed" and statuses["numerics"] == "skipped"


def test_flipped_byte_fails_the_checksum(source: Path, tmp_path: Path, cli) -> None:
    cli("consolidate", source, tmp_path / "out", "--format", "megatron")
    path = tmp_path / "out/iter_0000001/mp_rank_00/model_optim_rng.pt"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    result = cli("verify", tmp_path / "out", code=1)
    assert (
        "failed manifest" in result.stdout.replace("  ", " ") or "checksum differs" in result.stdout
    )


def test_nan_is_found(source: Path, tmp_path: Path, cli) -> None:
    cli("consolidate", source, tmp_path / "out", "--format", "megatron")
    path = tmp_path / "out/iter_0000001/mp_rank_00/model_optim_rng.pt"
    data = torch.load(path, weights_only=False)
    data["model"]["decoder.final_layernorm.weight"][3] = float("nan")
    torch.save(data, path)
    report = json.loads(cli("verify", tmp_path / "out", "--numerics", "--json", code=1).stdout)
    numerics = next(c for c in report["checks"] if c["name"] == "numerics")
    assert numerics["status"] == "failed" and "final_layernorm" in numerics["detail"]


def test_interrupted_output_is_refused_by_readers(source: Path, tmp_path: Path, cli) -> None:
    cli("consolidate", source, tmp_path / "out", "--format", "megatron")
    (tmp_path / "out/ckptctl.incomplete").write_text("{}")
    refused = cli("inspect", tmp_path / "out", code=3)
    assert "never completed" in refused.stderr
    report = json.loads(cli("verify", tmp_path / "out", "--json", code=1).stdout)
    assert _statuses(report)["complete"] == "failed" and not report["ok"]


def test_against_compares_across_layouts_and_formats(source: Path, tmp_path: Path, cli) -> None:
    cli("reshard", source, tmp_path / "tp4", "--tp", "4", "--pp", "1")
    cli("consolidate", source, tmp_path / "hf")
    report = cli.json("verify", tmp_path / "tp4", "--against", source)
    against = next(c for c in report["checks"] if c["name"] == "against")
    assert against["status"] == "passed" and "bit-exact" in against["detail"]
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    assert any(t["name"].startswith("exp_avg/") for t in report["tensors"])
    # HF holds the weights alone: compared with a checkpoint holding Adam state too, the
    # comparison fails naming what only the other side holds, unless narrowed to the weights.
    failed = json.loads(
        cli("verify", tmp_path / "hf", "--against", source, "--json", code=1).stdout
    )
    assert failed["against"]["only_there"] and not failed["against"]["only_here"]
    states = {n.split("/")[0] for n in failed["against"]["only_there"]}
    assert states <= {"fp32_param", "exp_avg", "exp_avg_sq", "step"} and "exp_avg" in states
    weights = cli.json("verify", tmp_path / "hf", "--against", source, "--weights-only")
    assert weights["against"]["compared"] == weights["against"]["held"][0] == 51
    # bf16 copy: differs bit-wise, passes within a tolerance, and says by how much.
    cli("consolidate", source, tmp_path / "bf16", "--dtype", "bf16")
    failed = json.loads(
        cli("verify", tmp_path / "bf16", "--against", tmp_path / "hf", "--json", code=1).stdout
    )
    worst = max(t["max_abs_diff"] for t in failed["tensors"])
    assert 0 < worst < 0.1
    cli.json("verify", tmp_path / "bf16", "--against", tmp_path / "hf", "--atol", "0.1")


def test_sha256_on_request_and_allow_incomplete(source: Path, tmp_path: Path, cli) -> None:
    cli("consolidate", source, tmp_path / "out", "--format", "megatron", "--checksum", "sha256")
    manifest = json.loads((tmp_path / "out/ckptctl.manifest.json").read_text())
    assert manifest["checksum"] == "sha256"
    digest = manifest["files"]["iter_0000001/mp_rank_00/model_optim_rng.pt"]["checksum"]
    assert len(digest) == 64
    assert cli.json("verify", tmp_path / "out")["ok"]
    (tmp_path / "out/ckptctl.incomplete").write_text("{}")
    cli("inspect", tmp_path / "out", code=3)
    cli("--allow-incomplete", "inspect", tmp_path / "out")
