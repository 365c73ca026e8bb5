"""Reads of a checkpoint ckptctl wrote are held to its manifest's checksums: a safetensors
tensor changed after writing (its format stores no checksum) is refused, whether it is read
whole (a consolidation) or in parts (a reshard cutting it), locally and from an object store;
nothing is marked complete, and the untouched checkpoint still converts."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from ckptctl import synth
from tests.io import test_s3

s3_endpoint, bucket = test_s3.s3_endpoint, test_s3.bucket  # moto's S3 server fixtures


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from typer.testing import CliRunner

    from ckptctl.cli.main import app

    root = tmp_path_factory.mktemp("manifest-reads")
    model = synth.make_model(synth.tiny_llama_config(num_heads=8, num_kv_heads=4), seed=7)
    synth.write_megatron(model, synth.adam_step(model, seed=7), root / "src", tp=2, pp=1)
    result = CliRunner().invoke(app, ["consolidate", str(root / "src"), str(root / "hf")])
    assert result.exit_code == 0, result.stderr
    return root / "hf"


def _damaged(hf: Path, out: Path, tensor: str, how: str) -> Path:
    """A copy of ``hf`` with one element of ``tensor`` changed (a bit flipped, or NaN)."""
    import shutil

    shutil.copytree(hf, out)
    path = out / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8 : 8 + n])[tensor]
    at = 8 + n + entry["data_offsets"][0] + 4 * 3  # the fourth float32 element
    if how == "flip":
        raw[at] ^= 0x01
    else:
        raw[at : at + 4] = struct.pack("<f", math.nan)
    path.write_bytes(bytes(raw))
    return out


@pytest.mark.parametrize("how", ["flip", "nan"])
@pytest.mark.parametrize(
    "command",
    [
        ("consolidate", "--format", "hf"),
        ("consolidate", "--format", "megatron"),
        ("reshard", "--tp", "2", "--pp", "1"),
    ],
    ids=["hf", "megatron", "reshard-tp2"],
)
def test_a_changed_tensor_is_refused(hf: Path, tmp_path: Path, cli, how: str, command) -> None:
    for tensor in ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight"):
        src = _damaged(hf, tmp_path / f"src-{tensor}", tensor, how)
        result = cli(command[0], src, tmp_path / f"out-{tensor}", *command[1:], code=3)
        assert tensor in result.stderr and "manifest" in result.stderr
        assert not (tmp_path / f"out-{tensor}" / "ckptctl.manifest.json").exists()
        report = json.loads(cli("verify", src, "--json", code=1).stdout)
        assert not report["ok"]


def test_the_intact_checkpoint_converts(hf: Path, tmp_path: Path, cli) -> None:
    cli("reshard", hf, tmp_path / "tp2", "--tp", "2", "--pp", "1")
    cli("consolidate", hf, tmp_path / "again")
    assert cli.json("verify", tmp_path / "again", "--against", hf)["ok"]


def test_on_an_object_store(hf: Path, tmp_path: Path, cli, bucket: str) -> None:
    import fsspec

    src = _damaged(hf, tmp_path / "bad", "model.layers.0.mlp.down_proj.weight", "flip")
    fs = fsspec.filesystem("s3")
    fs.put(str(src), f"{bucket}/bad", recursive=True)
    for command in (("consolidate", "--format", "hf"), ("reshard", "--tp", "2", "--pp", "1")):
        result = cli(command[0], f"{bucket}/bad", tmp_path / command[0], *command[1:], code=3)
        assert "down_proj" in result.stderr and "manifest" in result.stderr
