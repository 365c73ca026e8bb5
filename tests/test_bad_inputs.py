"""Bad input: a one-line error naming the file or value, a non-zero exit, no traceback, the
source untouched and nothing at the destination that looks complete."""

from __future__ import annotations

import argparse
import hashlib
import io
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl import synth

RANK0 = "iter_0000001/mp_rank_00_000/model_optim_rng.pt"


@pytest.fixture(scope="module")
def source_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = synth.make_model(synth.tiny_llama_config(num_layers=4), seed=0)
    states = synth.adam_step(model, seed=0)
    out = tmp_path_factory.mktemp("bad") / "src"
    synth.write_megatron(model, states, out, tp=2, pp=2)
    return out


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _copy(src: Path, dst: Path) -> Path:
    for p in src.rglob("*"):
        if p.is_file():
            target = dst / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(p.read_bytes())
    return dst


def _rewrite_rank0(root: Path, edit: Callable[[dict], None]) -> None:
    path = root / RANK0
    data = torch.load(path, weights_only=False)
    edit(data)
    torch.save(data, path)


def _truncate(root: Path) -> None:
    path = root / RANK0
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_header(root: Path) -> None:
    path = root / RANK0
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF
    path.write_bytes(bytes(raw))


def _malicious(root: Path) -> None:
    marker = root.parent / "pwned"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (open, (str(marker), "w"))

    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(), "model": {}}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            payload = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                payload = pickle.dumps({"args": Evil()}, protocol=2)
            dst.writestr(info, payload)
    (root / RANK0).write_bytes(out.getvalue())


def _not_a_checkpoint(root: Path) -> None:
    shutil.rmtree(root)
    root.mkdir()
    (root / "notes.txt").write_text("hello")


def _tp3(data: dict) -> None:
    data["args"].tensor_model_parallel_size = 3


def _shape_mismatch(data: dict) -> None:
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    data["model"][name] = data["model"][name][:-2].clone()


def _args_disagree(data: dict) -> None:
    data["args"].hidden_size = 128


CASES: dict[str, tuple[Callable[[Path], None], str, int]] = {
    "missing rank dir": (
        lambda r: (
            [p.unlink() for p in (r / "iter_0000001/mp_rank_01_001").iterdir()]
            and (r / "iter_0000001/mp_rank_01_001").rmdir()
        ),
        "missing rank directories mp_rank_01_001",
        3,
    ),
    "truncated pt": (_truncate, "mp_rank_00_000/model_optim_rng.pt: not a readable torch", 3),
    "flipped zip magic": (_flip_header, "mp_rank_00_000/model_optim_rng.pt", 3),
    "tracker names missing iteration": (
        lambda r: (r / "latest_checkpointed_iteration.txt").write_text("7"),
        "names iteration 7 but iter_0000007/ is missing",
        3,
    ),
    "tracker garbage": (
        lambda r: (r / "latest_checkpointed_iteration.txt").write_text("latest!"),
        "expected an iteration number",
        3,
    ),
    "tp does not divide heads": (
        lambda r: _rewrite_rank0(r, _tp3),
        "tp=3 does not divide num_query_groups=2",
        2,
    ),
    "shape mismatch": (
        lambda r: _rewrite_rank0(r, _shape_mismatch),
        "linear_qkv.weight has shape [62, 64], expected [64, 64]",
        3,
    ),
    "args disagree": (
        lambda r: _rewrite_rank0(r, _args_disagree),
        "args.hidden_size=",
        3,
    ),
    "malicious pickle": (_malicious, "refusing pickled global io.open", 3),
    "not a checkpoint": (
        _not_a_checkpoint,
        "neither a Megatron checkpoint",
        3,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", ["inspect", "consolidate"])
def test_bad_input(source_template: Path, tmp_path: Path, cli, case: str, command: str) -> None:
    corrupt, message, code = CASES[case]
    src = _copy(source_template, tmp_path / "src")
    corrupt(src)
    before = _digest(src)
    dst = tmp_path / "out"
    args = [command, src] + ([dst] if command == "consolidate" else [])
    result = cli(*args, code=code)
    err = result.stderr
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _digest(src) == before
    assert not (tmp_path / "pwned").exists()
    assert not (dst / "config.json").exists() and not (dst / "model.safetensors").exists()


def test_existing_output_needs_overwrite(source_template: Path, tmp_path: Path, cli) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    result = cli("consolidate", source_template, dst, code=2)
    assert "--overwrite" in result.stderr
    assert (dst / "keep.txt").read_text() == "mine"
    cli("consolidate", source_template, dst, "--overwrite")
    assert (dst / "config.json").exists() and not (dst / "keep.txt").exists()


def test_debug_shows_traceback(source_template: Path, tmp_path: Path, cli) -> None:
    src = _copy(source_template, tmp_path / "src")
    _truncate(src)
    result = cli.runner.invoke(
        __import__("ckptctl.cli.main").cli.main.app, ["--debug", "inspect", str(src)]
    )
    assert result.exit_code != 0 and result.exception is not None
