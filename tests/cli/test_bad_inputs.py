"""Bad input: a one-line error naming the file or value, a non-zero exit, no traceback, the
source untouched and nothing at the destination that looks complete."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
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


def test_tensors_pickled_with_attributes_load_and_other_types_are_refused() -> None:
    from ckptctl.errors import UnsafePickleError
    from ckptctl.formats.torchsave.unpickle import TensorRef, restricted_loads

    # Megatron's fp32 master copies carry tensor-parallel attributes, so torch pickles them
    # through _rebuild_from_type_v2; they load as plain tensors.
    master = torch.arange(6.0).view(2, 3)
    master.tensor_model_parallel = True
    buf = io.BytesIO()
    torch.save({"fp32_from_fp16_params": [[master]]}, buf)
    archive = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    ref = restricted_loads(data, "masters.pt")["fp32_from_fp16_params"][0][0]
    assert isinstance(ref, TensorRef) and ref.shape == (2, 3)

    class Rebuilt:  # the same call rebuilding as something that is not a tensor type
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (
                torch._tensor._rebuild_from_type_v2,
                (torch._utils._rebuild_tensor_v2, argparse.Namespace, (), {}),
            )

    with pytest.raises(UnsafePickleError, match="refusing to rebuild a tensor"):
        restricted_loads(pickle.dumps(Rebuilt(), protocol=2), "evil.pt")


def _not_a_checkpoint(root: Path) -> None:
    shutil.rmtree(root)
    root.mkdir()
    (root / "notes.txt").write_text("hello")


def _distributed(root: Path, drop: str) -> None:
    shutil.rmtree(root)
    model = synth.make_model(synth.tiny_llama_config(num_layers=4), seed=0)
    synth.write_megatron(
        model, synth.adam_step(model, seed=0), root, tp=2, pp=2, dp=2, distributed_optimizer=True
    )
    (root / drop).unlink()


def _rewrite(path: Path, edit: Callable[[dict], None]) -> None:
    data = torch.load(path, weights_only=False)
    edit(data)
    torch.save(data, path)


def _flag_distributed(data: dict) -> None:
    data["args"].use_distributed_optimizer = True


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
    # A checkpoint whose args cannot describe its own layout is bad input (3), not a bad flag.
    "tp does not divide heads": (
        lambda r: _rewrite_rank0(r, _tp3),
        "tp=3 does not divide num_query_groups=2",
        3,
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
    # --overwrite replaces only what ckptctl wrote: a directory of someone else's files stays.
    result = cli("consolidate", source_template, dst, "--overwrite", code=2)
    assert "keep.txt" in result.stderr and "no ckptctl job wrote" in result.stderr
    assert (dst / "keep.txt").read_text() == "mine"
    (dst / "keep.txt").unlink()
    cli("consolidate", source_template, dst)
    cli("consolidate", source_template, dst, "--format", "megatron", "--overwrite")
    assert (dst / "latest_checkpointed_iteration.txt").exists()
    assert not (dst / "config.json").exists()


def test_debug_shows_traceback(source_template: Path, tmp_path: Path, cli) -> None:
    src = _copy(source_template, tmp_path / "src")
    _truncate(src)
    result = cli.runner.invoke(
        __import__("ckptctl.cli.main").cli.main.app, ["--debug", "inspect", str(src)]
    )
    assert result.exit_code != 0 and result.exception is not None


# --- more of the corpus: Megatron files, HF files, impossible targets ---------------------------


def _edit(key: str, value: object) -> Callable[[Path], None]:
    def corrupt(root: Path) -> None:
        def edit(data: dict) -> None:
            node = data
            parts = key.split("/")
            for part in parts[:-1]:
                node = node[part] if isinstance(node, dict) else getattr(node, part)
            if isinstance(node, dict):
                node[parts[-1]] = value(node[parts[-1]]) if callable(value) else value
            else:
                setattr(node, parts[-1], value)

        _rewrite_rank0(root, edit)

    return corrupt


QKV = "model/decoder.layers.0.self_attention.linear_qkv.weight"
MORE: dict[str, tuple[Callable[[Path], None], str, int]] = {
    "empty rank file": (
        lambda r: (r / RANK0).write_bytes(b""),
        "mp_rank_00_000/model_optim_rng.pt: not a readable torch",
        3,
    ),
    "empty tracker": (
        lambda r: (r / "latest_checkpointed_iteration.txt").write_text(""),
        "expected an iteration number",
        3,
    ),
    "zero-size tensor": (
        _edit(QKV, lambda t: t[:0].clone()),
        "linear_qkv.weight has shape [0, 64], expected [64, 64]",
        3,
    ),
    "integer dtype": (
        _edit(QKV, lambda t: t.to(torch.int32)),
        "has dtype int32; only floating-point weights are supported",
        3,
    ),
    "unknown extra tensor": (
        _edit("model/decoder.layers.0.mystery.weight", torch.zeros(3)),
        "unexpected tensor model.decoder.layers.0.mystery.weight",
        3,
    ),
    "unknown extra rank dir": (
        lambda r: shutil.copytree(
            r / "iter_0000001/mp_rank_00_000", r / "iter_0000001/mp_rank_07_000"
        ),
        "rank directories mp_rank_07_000 do not belong to TP2 PP2",
        3,
    ),
    "distributed optimizer file missing": (
        lambda r: _distributed(r, drop="iter_0000001/mp_rank_01_001/distrib_optim.pt"),
        "mp_rank_01_001/distrib_optim.pt: file not found",
        3,
    ),
    "distributed flag without its state": (
        lambda r: [_rewrite(p, _flag_distributed) for p in r.rglob("model_optim_rng.pt")],
        "is not the distributed optimizer's",
        3,
    ),
    "no args": (
        lambda r: _rewrite_rank0(r, lambda d: d.pop("args")),
        "no 'args' namespace",
        3,
    ),
    "experts on one rank only": (
        _edit("args/num_experts", 8),
        "args.num_experts=None disagrees with 8",
        3,
    ),
    # Multi-latent attention is read (issue 54); a grouped-query model cannot have it.
    "multi-latent attention over grouped-query args": (
        _edit("args/multi_latent_attention", True),
        "multi-latent attention has a key/value per head",
        3,
    ),
    "multi-token prediction layers the files lack": (
        _edit("args/mtp_num_layers", 1),
        "args.mtp_num_layers=1 but the files hold no multi-token prediction layer",
        3,
    ),
    "empty iteration dir": (
        lambda r: [shutil.rmtree(p) for p in (r / "iter_0000001").iterdir()],
        "no mp_rank_* directories",
        3,
    ),
}


@pytest.mark.parametrize("case", list(MORE))
def test_more_bad_megatron_inputs(source_template: Path, tmp_path: Path, cli, case: str) -> None:
    corrupt, message, code = MORE[case]
    _check_refused(source_template, tmp_path, cli, corrupt, ["consolidate"], message, code)


def _check_refused(template, tmp_path, cli, corrupt, command, message, code, extra=()) -> None:
    src = _copy(template, tmp_path / "src")
    corrupt(src)
    before = _digest(src)
    dst = tmp_path / "out"
    result = cli(*command, src, dst, *extra, code=code)
    err = result.stderr
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _digest(src) == before
    assert not (dst / "ckptctl.manifest.json").exists()
    assert not (dst / "latest_checkpointed_iteration.txt").exists()


@pytest.fixture(scope="module")
def hf_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = synth.make_model(synth.tiny_llama_config(num_layers=2), seed=0)
    out = tmp_path_factory.mktemp("badhf") / "hf"
    synth.save_hf(model, str(out))
    return out


def _json_edit(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def corrupt(root: Path) -> None:
        data = json.loads((root / name).read_text())
        change(data)
        (root / name).write_text(json.dumps(data))

    return corrupt


def _sharded_hf(root: Path) -> None:
    """Give the single-file model an index, the form the index cases corrupt."""
    names = json.loads(_safetensors_header(root / "model.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {k: "model.safetensors" for k in names if k != "__metadata__"},
    }
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _safetensors_header(path: Path) -> str:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw[8 : 8 + n].decode()


def _rewrite_header(root: Path, change: Callable[[dict], None]) -> None:
    path = root / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    change(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n :])


def _both(*steps: Callable[[Path], None]) -> Callable[[Path], None]:
    def corrupt(root: Path) -> None:
        for step in steps:
            step(root)

    return corrupt


HF_CASES: dict[str, tuple[Callable[[Path], None], str, int]] = {
    "config not json": (
        lambda r: (r / "config.json").write_text("{nope"),
        "config.json: not JSON",
        3,
    ),
    # No family table takes gpt2, so transformers judges the config: its architecture
    # (LlamaForCausalLM) is no gpt2 model.
    "not llama": (
        _json_edit("config.json", lambda c: c.update(model_type="gpt2")),
        "model_type is 'gpt2', but LlamaForCausalLM is a 'llama' model",
        3,
    ),
    "index without weight_map": (
        _both(
            _sharded_hf, _json_edit("model.safetensors.index.json", lambda i: i.pop("weight_map"))
        ),
        "malformed index",
        3,
    ),
    "index path escapes root": (
        _both(
            _sharded_hf,
            _json_edit(
                "model.safetensors.index.json",
                lambda i: i["weight_map"].update({"model.norm.weight": "../../etc/passwd"}),
            ),
        ),
        "escapes the checkpoint root",
        3,
    ),
    "truncated safetensors": (
        lambda r: (r / "model.safetensors").write_bytes(b"\x10\x00"),
        "too short for a safetensors file",
        3,
    ),
    "unknown safetensors dtype": (
        lambda r: _rewrite_header(r, lambda h: h["model.norm.weight"].update(dtype="Q8")),
        "model.norm.weight has unsupported dtype Q8",
        3,
    ),
    "tensor missing from shard": (
        lambda r: _rewrite_header(r, lambda h: h.pop("model.norm.weight")),
        "tensor model.norm.weight missing",
        3,
    ),
    "wrong shape in shard": (
        lambda r: _rewrite_header(r, lambda h: h["model.norm.weight"].update(shape=[8, 8])),
        "model.norm.weight has shape [8, 8], expected [64]",
        3,
    ),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_bad_hf_inputs(hf_template: Path, tmp_path: Path, cli, case: str) -> None:
    corrupt, message, code = HF_CASES[case]
    _check_refused(
        hf_template, tmp_path, cli, corrupt, ["reshard"], message, code, extra=("--tp", "2")
    )


IMPOSSIBLE = {
    "tp not dividing groups": (["--tp", "3"], "tp=3 does not divide num_query_groups=2", 2),
    "pp not dividing layers": (["--pp", "3"], "cannot split the remaining 4", 2),
    "vpp not dividing stage": (["--pp", "2", "--vpp", "3"], "vpp=3 does not divide", 2),
    "uneven stages too big": (
        ["--pp", "2", "--pp-first-stage-layers", "9"],
        "do not fit num_layers=4",
        2,
    ),
    "bad memory budget": (["--memory-budget", "lots"], "cannot read size 'lots'", 2),
    "bad rank list": (["--lost-ranks", "one"], "cannot read rank list 'one'", 2),
}


@pytest.mark.parametrize("case", list(IMPOSSIBLE))
def test_impossible_targets(source_template: Path, tmp_path: Path, cli, case: str) -> None:
    flags, message, code = IMPOSSIBLE[case]
    _check_refused(
        source_template,
        tmp_path,
        cli,
        lambda r: None,
        ["reshard"],
        message,
        code,
        extra=tuple(flags),
    )


def test_corpus_has_at_least_thirty_cases() -> None:
    assert len(CASES) + len(MORE) + len(HF_CASES) + len(IMPOSSIBLE) + len(DCP_CASES) >= 30


# --- DCP / torch_dist ------------------------------------------------------------------------

METADATA = "iter_0000001/.metadata"


@pytest.fixture(scope="module")
def torch_dist_template(source_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from typer.testing import CliRunner

    from ckptctl.cli.main import app

    out = tmp_path_factory.mktemp("baddcp") / "td"
    result = CliRunner().invoke(
        app, ["reshard", str(source_template), str(out), "--tp", "2", "--format", "torch_dist"]
    )
    assert result.exit_code == 0, result.stderr
    (out / "ckptctl.manifest.json").unlink()  # as a training job would have written it
    return out


def _edit_metadata(change: Callable[[object], None]) -> Callable[[Path], None]:
    def corrupt(root: Path) -> None:
        path = root / METADATA
        meta = pickle.loads(path.read_bytes())  # trusted here: the test wrote it
        change(meta)
        path.write_bytes(pickle.dumps(meta))

    return corrupt


def _malicious_metadata(root: Path) -> None:
    marker = root.parent / "pwned"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (open, (str(marker), "w"))

    (root / METADATA).write_bytes(pickle.dumps({"state_dict_metadata": Evil()}))


def _escaping_record(meta: object) -> None:
    for info in meta.storage_data.values():  # type: ignore[attr-defined]
        info.relative_path = "../../../etc/passwd"
        break


def _drop_chunk(meta: object) -> None:
    entry = meta.state_dict_metadata["decoder.final_layernorm.weight"]  # type: ignore[attr-defined]
    entry.chunks.clear()


def _truncate_shards(root: Path) -> None:
    for path in (root / "iter_0000001").glob("*.distcp"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


DCP_CASES: dict[str, tuple[Callable[[Path], None], str, int]] = {
    "malicious .metadata": (_malicious_metadata, "refusing pickled global", 3),
    "truncated .metadata": (
        lambda r: (r / METADATA).write_bytes((r / METADATA).read_bytes()[:50]),
        ".metadata",
        3,
    ),
    "record path escapes root": (
        _edit_metadata(_escaping_record),
        "../../../etc/passwd",
        3,
    ),
    "chunk missing from .metadata": (
        _edit_metadata(_drop_chunk),
        "decoder.final_layernorm.weight",
        3,
    ),
    "truncated .distcp shards": (_truncate_shards, ".distcp", 3),
    "common.pt missing": (lambda r: (r / "iter_0000001/common.pt").unlink(), "common.pt", 3),
    "unsupported sharded backend": (
        lambda r: (r / "iter_0000001/metadata.json").write_text('{"sharded_backend": "zarr"}'),
        "sharded_backend 'zarr' is not supported",
        3,
    ),
}


@pytest.mark.parametrize("case", list(DCP_CASES))
def test_bad_dcp_inputs(torch_dist_template: Path, tmp_path: Path, cli, case: str) -> None:
    corrupt, message, code = DCP_CASES[case]
    _check_refused(torch_dist_template, tmp_path, cli, corrupt, ["consolidate"], message, code)
    assert not (tmp_path / "pwned").exists(), "the malicious pickle ran"


def test_a_directory_where_an_output_file_goes_fails_and_leaves_no_partial_file(
    tmp_path: Path,
) -> None:
    from ckptctl.io.storage import Storage

    (tmp_path / "model.safetensors" / "inner").mkdir(parents=True)
    with (
        pytest.raises(IsADirectoryError, match=r"model\.safetensors"),
        Storage(str(tmp_path)).open_write("model.safetensors") as out,
    ):
        out.write(b"weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors" / "inner").is_dir()  # nothing of theirs touched
