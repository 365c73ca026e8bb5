"""A new user's first run and the mistakes users make: every dependency declared, sources never
harmed whatever the path spelling, corruption in foreign files caught by verify, saved plans
refused when their source changed, storage failures reported as storage errors (fast), one JSON
error document under --json, and the CLI conventions of the aws and hf CLIs."""

from __future__ import annotations

import ast
import errno
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from ckptctl import synth
from ckptctl.io.locations import Overlap, overlap
from ckptctl.io.storage_errors import classify

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = synth.make_model(synth.tiny_llama_config(num_layers=2), seed=0)
    states = synth.adam_step(model, seed=0)
    out = tmp_path_factory.mktemp("first") / "ck"
    synth.write_megatron(model, states, out, tp=2, pp=2)
    return out


@pytest.fixture
def ck(template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "ck"))


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


# --- 1. every dependency declared ---------------------------------------------------------------


def test_every_third_party_import_of_the_package_is_a_declared_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {
        re.split(r"[ <>=!~;\[]", d, maxsplit=1)[0].lower().replace("_", "-")
        for d in project["dependencies"]
    }
    owners = md.packages_distributions()
    missing = set()
    for package in ("ckptctl", "planners"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in ("ckptctl", "planners"):
                        continue
                    # Optional imports of the demo's extra are guarded and declared there.
                    dists = {d.lower().replace("_", "-") for d in owners.get(top, [top])}
                    if not dists & declared and top != "transformers":
                        missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_ci_runs_the_readme_quickstart_in_a_fresh_venv() -> None:
    commands = subprocess.run(
        [sys.executable, str(ROOT / ".ci/quickstart.py"), str(ROOT / "README.md")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(commands) == 2
    assert "ckptctl demo" in commands[0] and "pytest" in commands[1]
    ci = (ROOT / ".ci/run").read_text()
    assert "-m venv" in ci and "system-site-packages" not in ci and "quickstart.py" in ci


# --- 2. no command can write into a source ------------------------------------------------------

SAME = ["{ck}", "{ck}/", "./ck", "ck/../ck", "ck/./", "link", "link/", "file://{ck}", "{ck}/x/.."]
INSIDE = ["{ck}/out", "ck/iter_0000001/new", "link/out", "file://{ck}/out", "./ck//deep/er"]
CONTAINS = [".", "{tmp}", "ck/..", "file://{tmp}"]


@pytest.mark.parametrize(
    ("spelling", "relation"),
    [(s, Overlap.SAME) for s in SAME]
    + [(s, Overlap.INSIDE) for s in INSIDE]
    + [(s, Overlap.CONTAINS) for s in CONTAINS],
)
@pytest.mark.parametrize("command", ["consolidate", "reshard"])
def test_a_destination_overlapping_the_source_is_refused_before_anything_is_touched(
    ck: Path, tmp_path: Path, spelling: str, relation: Overlap, command: str, cli, monkeypatch
) -> None:
    (tmp_path / "link").symlink_to(ck)
    monkeypatch.chdir(tmp_path)
    dst = spelling.format(ck=ck, tmp=tmp_path)
    before = digest(tmp_path)
    args = [command, "ck", dst, "--overwrite"] + (["--tp", "1"] if command == "reshard" else [])
    result = cli(*args, code=2)
    line = one_line_error(result.stderr)
    assert f"destination {dst} {relation.value} the source ck" in line
    assert digest(tmp_path) == before, "the source tree changed"


def test_locations_of_object_store_urls_ignore_spelling() -> None:
    assert overlap("s3://b/p", "s3://b/p/") is Overlap.SAME
    assert overlap("s3a://b//p", "s3://b/p") is Overlap.SAME
    assert overlap("s3://b/p/sub", "s3://b/p") is Overlap.INSIDE
    assert overlap("s3://b", "s3://b/p") is Overlap.CONTAINS
    assert overlap("s3://b/p2", "s3://b/p") is None
    assert overlap("s3://other/p", "s3://b/p") is None
    assert overlap("/b/p", "s3://b/p") is None


def test_every_output_option_is_kept_out_of_every_source(
    ck: Path, tmp_path: Path, cli, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    full = Path(shutil.copytree(ck, tmp_path / "full"))
    before = {p: digest(p) for p in (ck, full)}
    cases = [
        ("reshard", "ck", "out", "--tp", "1", "--stage-dir", "ck/stage"),
        ("reshard", "ck", "out", "--tp", "1", "--via-full", "ck/full"),
        ("reshard", "ck", "full/out", "--tp", "1", "--full", "full"),
        ("reshard", "ck", "full/out", "--tp", "1", "--replica", "full"),
        ("plan", "ck", "--tp", "1", "--out", "ck/plan.json"),
        ("plan", "ck", "--tp", "1", "--svg", "ck/map.svg"),
    ]
    for args in cases:
        line = one_line_error(cli(*args, code=2).stderr)
        assert "never writes into or over a source" in line, args
    assert {p: digest(p) for p in (ck, full)} == before
    assert not (tmp_path / "out").exists()


def test_overwrite_removes_only_a_previous_ckptctl_output(ck: Path, tmp_path: Path, cli) -> None:
    foreign = Path(shutil.copytree(ck, tmp_path / "someone_elses"))
    before = digest(foreign)
    line = one_line_error(cli("reshard", ck, foreign, "--tp", "1", "--overwrite", code=2).stderr)
    assert "which no ckptctl job wrote" in line and "holds iter_0000001/" in line
    assert digest(foreign) == before
    out = tmp_path / "out"
    cli("reshard", ck, out, "--tp", "1")
    (out / "notes.md").write_text("mine")  # the user adds a file to a ckptctl output
    one_line_error(cli("reshard", ck, out, "--tp", "2", "--pp", "1", "--overwrite", code=2).stderr)
    assert (out / "notes.md").read_text() == "mine"
    (out / "notes.md").unlink()
    cli("reshard", ck, out, "--tp", "2", "--pp", "1", "--overwrite")
    assert json.loads(cli("inspect", out, "--json").stdout)["layout"]["tp"] == 2


# --- 3. corruption in foreign files is caught by verify -----------------------------------------


def _data_spans(path: Path) -> list[tuple[int, int]]:
    """(start, end) of the tensor bytes of every storage record in a file's zip archives."""
    from ckptctl.checksums.integrity import zip_entries

    spans = []
    raw = path.read_bytes()
    with path.open("rb") as f:
        entries = _dcp_entries(path) if path.suffix == ".distcp" else zip_entries(f, str(path))
    for e in entries:
        if "/data/" not in e.name or e.size == 0:
            continue
        name_len, extra_len = (
            int.from_bytes(raw[e.header_offset + k : e.header_offset + k + 2], "little")
            for k in (26, 28)
        )
        start = e.header_offset + 30 + name_len + extra_len
        spans.append((start, start + e.size))
    return spans


def _dcp_entries(path: Path) -> list:
    from ckptctl.pipeline.probe import format_of, open_checkpoint

    ckpt = open_checkpoint(str(path.parent))
    targets = format_of(ckpt).checksums(ckpt)
    return targets.zips[path.name]


def _flip_sweep(root: Path, rel: str, cli, n: int = 6) -> None:
    import random

    path = root / rel
    spans = _data_spans(path)
    assert spans, f"no tensor data found in {rel}"
    rng = random.Random(rel)
    original = path.read_bytes()
    for _ in range(n):
        start, end = rng.choice(spans)
        pos = rng.randrange(start, end)
        corrupt = bytearray(original)
        corrupt[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(corrupt))
        report = json.loads(cli("verify", root, "--json", code=1).stdout)
        failed = {c["name"]: c["detail"] for c in report["checks"] if c["status"] == "failed"}
        assert set(failed) == {"checksums"}, (pos, report)
        assert "CRC-32 mismatch" in failed["checksums"] and rel in failed["checksums"]
    path.write_bytes(original)
    assert json.loads(cli("verify", root, "--json").stdout)["ok"]


def test_any_flipped_bit_in_a_foreign_megatron_shard_or_distrib_optim_fails_verify(
    tmp_path: Path, cli
) -> None:
    model = synth.make_model(synth.tiny_llama_config(num_layers=2), seed=1)
    states = synth.adam_step(model, seed=1)
    root = tmp_path / "distopt"
    synth.write_megatron(model, states, root, tp=1, pp=1, dp=2, distributed_optimizer=True)
    _flip_sweep(root, "iter_0000001/mp_rank_00/model_optim_rng.pt", cli)
    _flip_sweep(root, "iter_0000001/mp_rank_00/distrib_optim.pt", cli)


def test_any_flipped_bit_in_a_torch_dcp_shard_fails_verify(tmp_path: Path, cli) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "dcp"
    state = {"model": {"w": torch.randn(64, 32), "b": torch.randn(32)}, "step": 3}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=str(root))
    _flip_sweep(root, "__0_0.distcp", cli)


def test_a_reshard_refuses_a_record_that_fails_its_crc(ck: Path, tmp_path: Path, cli) -> None:
    path = ck / "iter_0000001/mp_rank_00_000/model_optim_rng.pt"
    start, end = max(_data_spans(path), key=lambda s: s[1] - s[0])
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    result = cli("reshard", ck, tmp_path / "out", "--tp", "1", code=3)
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "fails its CRC-32 check" in line and "mp_rank_00_000" in line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out/ckptctl.manifest.json").exists()


def _record_span(path: Path, tensor: str) -> tuple[int, int]:
    """(start, end) in ``path`` of the bytes of the storage record holding ``tensor``."""
    from ckptctl.formats.torchsave.archive import TorchZipReader

    with path.open("rb") as f:
        ref = TorchZipReader(f, str(path)).tree["model"][tensor]
        key = ref.storage.key
    from ckptctl.checksums.integrity import zip_entries

    with path.open("rb") as f:
        (entry,) = [e for e in zip_entries(f, str(path)) if e.name.endswith(f"/data/{key}")]
    raw = path.read_bytes()
    name_len, extra_len = (
        int.from_bytes(raw[entry.header_offset + k : entry.header_offset + k + 2], "little")
        for k in (26, 28)
    )
    start = entry.header_offset + 30 + name_len + extra_len
    return start, start + entry.size


@pytest.mark.parametrize(
    "tensor",
    [
        # each TP2 rank reads half the columns of every row: strided boxes
        "decoder.layers.0.self_attention.linear_proj.weight",
        # gate and up, each cut in two contiguous halves: runs of the record
        "decoder.layers.0.mlp.linear_fc1.weight",
        # rows cut into contiguous halves (padded to the new vocabulary where it changes)
        "embedding.word_embeddings.weight",
    ],
)
def test_a_reshard_refuses_a_corrupt_record_it_reads_only_part_of(
    tmp_path: Path, cli, tensor: str
) -> None:
    """No output file reads the whole record, so no single read can check its CRC-32: the
    record is checked whole once, and the job fails before anything is marked complete."""
    model = synth.make_model(synth.tiny_llama_config(num_layers=1), seed=2)
    ck = tmp_path / "tp1"
    synth.write_megatron(model, synth.adam_step(model, seed=2), ck, tp=1, pp=1)
    path = ck / "iter_0000001/mp_rank_00/model_optim_rng.pt"
    start, end = _record_span(path, tensor)
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    result = cli("reshard", ck, tmp_path / "out", "--tp", "2", code=3)
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "fails its CRC-32 check" in line and "mp_rank_00/model_optim_rng.pt" in line, line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out/ckptctl.manifest.json").exists()


@pytest.mark.parametrize(
    "tensor",
    ["decoder.layers.self_attention.linear_proj.weight", "decoder.layers.mlp.linear_fc1.weight"],
)
def test_a_reshard_refuses_a_corrupt_dcp_record_it_reads_only_part_of(
    tmp_path: Path, cli, tensor: str
) -> None:
    """The same for a torch_dist checkpoint, whose tensors are records inside one ``.distcp``
    file: each TP2 rank reads half of the record, the job checks it whole."""
    from torch.distributed.checkpoint import FileSystemReader

    model = synth.make_model(synth.tiny_llama_config(num_layers=1), seed=2)
    legacy, ck = tmp_path / "legacy", tmp_path / "td"
    synth.write_megatron(model, synth.adam_step(model, seed=2), legacy, tp=1, pp=1)
    cli("reshard", legacy, ck, "--tp", "1", "--pp", "1", "--format", "torch_dist")
    iteration = ck / "iter_0000001"
    stored = FileSystemReader(str(iteration)).read_metadata().storage_data
    (info,) = [v for k, v in stored.items() if k.fqn == tensor]
    path = iteration / info.relative_path
    raw = bytearray(path.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x10  # inside the tensor's bytes
    path.write_bytes(bytes(raw))
    result = cli("reshard", ck, tmp_path / "out", "--tp", "2", code=3)
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "fails its CRC-32 check" in line and info.relative_path in line, line
    assert not (tmp_path / "out/ckptctl.manifest.json").exists()


def test_verify_says_safetensors_carry_no_checksum(ck: Path, tmp_path: Path, cli) -> None:
    from safetensors.torch import load_file, save_file

    cli("consolidate", ck, tmp_path / "hf")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    shutil.copy(tmp_path / "hf/config.json", foreign)
    save_file(load_file(tmp_path / "hf/model.safetensors"), foreign / "model.safetensors")
    report = json.loads(cli("verify", foreign, "--json").stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["checksums"]["status"] == "skipped"
    assert "stores no checksum" in checks["checksums"]["detail"]
    assert "cannot be checked" in checks["checksums"]["detail"]
    with (foreign / "model.safetensors").open("ab") as f:
        f.write(b"\0" * 8)  # bytes after the last tensor: the header no longer fits the size
    report = json.loads(cli("verify", foreign, "--json", code=1).stdout)
    assert (
        "after the last tensor" in {c["name"]: c for c in report["checks"]}["checksums"]["detail"]
    )


# --- 4. saved plans fingerprint content ---------------------------------------------------------


def test_a_saved_plan_refuses_a_source_changed_in_place(ck: Path, tmp_path: Path, cli) -> None:
    plan = tmp_path / "plan.json"
    cli("plan", ck, tmp_path / "out", "--tp", "1", "--out", plan)
    rel = "iter_0000001/mp_rank_01_001/model_optim_rng.pt"
    path = ck / rel
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte changed
    time.sleep(0.01)
    path.write_bytes(bytes(raw))
    line = one_line_error(cli("reshard", ck, tmp_path / "out", "--plan", plan, code=3).stderr)
    assert f"{rel} (changed)" in line and "make a new plan" in line
    assert not (tmp_path / "out").exists()


# --- 5. storage failures are storage errors -----------------------------------------------------


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata service


@pytest.mark.parametrize("credentials", [True, False])
def test_an_unreachable_endpoint_fails_fast_with_exit_4(
    credentials: bool, no_aws_credentials, monkeypatch, cli
) -> None:
    if credentials:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    result = cli("--endpoint-url", "http://127.0.0.1:1", "inspect", "s3://nope/x", code=4)
    line = one_line_error(result.stderr)
    assert "cannot reach the object store at http://127.0.0.1:1" in line
    assert "--endpoint-url" in line and "internal error" not in line


@pytest.mark.parametrize(
    ("url", "words"),
    [("foo://bar/x", "unknown URL scheme 'foo'"), ("gs://bucket/x", "gcsfs")],
)
def test_an_unknown_or_unsupported_url_scheme_is_a_storage_error(url: str, words: str, cli) -> None:
    line = one_line_error(cli("inspect", url, code=4).stderr)
    assert url in line and words in line


def test_storage_errors_by_errno_name_the_path_and_the_fix() -> None:
    cases = {
        errno.ENOSPC: "no space left",
        errno.EROFS: "read-only file system",
        errno.EACCES: "permission denied",
        errno.EIO: "Input/output error",
    }
    for code, words in cases.items():
        err = classify(OSError(code, os.strerror(code), "/data/out/x.pt"))
        assert err is not None and err.exit_code == 4
        assert str(err).startswith("/data/out/x.pt: ") and words in str(err), str(err)
    assert classify(ValueError("a bug")) is None


def _mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "small"
    _mount_tmpfs(mount, "size=1m")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.fixture
def read_only_disk(tmp_path: Path):
    mount = tmp_path / "ro"
    _mount_tmpfs(mount, "size=1m,ro")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_destination_without_room_is_refused_before_writing(
    ck: Path, small_disk: Path, cli
) -> None:
    line = one_line_error(cli("reshard", ck, small_disk / "out", "--tp", "1", code=4).stderr)
    assert "is free there" in line and "missing" in line and "MiB" in line
    assert not any(small_disk.iterdir())


def test_a_read_only_destination_is_a_storage_error(ck: Path, read_only_disk: Path, cli) -> None:
    result = cli("consolidate", ck, read_only_disk / "hf", "--json", code=4)
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == 4 and "read-only file system" in doc["error"]
    assert "writable" in doc["hint"]


# --- 6. --json failures, CLI conventions, smaller findings --------------------------------------


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["inspect", "{tmp}/missing"], 3),
        (["reshard", "{ck}", "{ck}/out", "--tp", "1"], 2),
        (["reshard", "{ck}", "{tmp}/o", "--tp", "banana"], 2),
        (["inspect", "{ck}", "--no-such-flag"], 2),
        (["inspect", "foo://x/y"], 4),
    ],
)
def test_json_failures_print_one_error_document(
    ck: Path, tmp_path: Path, args: list[str], code: int, cli
) -> None:
    argv = [a.format(ck=ck, tmp=tmp_path) for a in args] + ["--json"]
    result = cli(*argv, code=code)
    doc = json.loads(result.stdout)
    assert set(doc) == {"error", "exit_code", "hint"} and doc["exit_code"] == code
    assert doc["error"]


def test_global_options_are_accepted_after_the_command(ck: Path, tmp_path: Path, cli) -> None:
    result = cli("inspect", "s3://nope/x", "--endpoint-url", "http://127.0.0.1:1", code=4)
    assert "cannot reach" in result.stderr
    result = cli("inspect", "s3://nope/x", "--endpoint-url=http://127.0.0.1:1", code=4)
    assert "cannot reach" in result.stderr
    (ck / "ckptctl.incomplete").write_text("{}")
    cli("inspect", ck, code=3)
    assert cli("inspect", ck, "--allow-incomplete", "--json").stdout


def test_formats_lists_what_is_read_and_written(cli) -> None:
    doc = json.loads(cli("formats", "--json").stdout)
    names = {f["name"] for f in doc["formats"]}
    assert {"megatron", "torch_dist", "dcp", "hf", "torch"} <= names
    assert "s3://" in doc["stores"]
    assert "megatron" in cli("formats").stdout


def test_shell_completion_and_closed_choices_in_help(cli, monkeypatch) -> None:
    # The shell is named, not detected from the processes above pytest (there may be none).
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    assert "complete" in cli("--show-completion", "bash").stdout.lower()
    from ckptctl.cli.main import app

    text = cli.runner.invoke(app, ["reshard", "--help"], env={"COLUMNS": "300"}).stdout
    for choice in ("auto", "direct", "recovery", "full-then-split", "megatron", "torch_dist"):
        assert choice in text
    text = cli.runner.invoke(app, ["consolidate", "--help"], env={"COLUMNS": "300"}).stdout
    assert "5GiB" in text and "GB" not in re.sub(r"GiB|MiB|KiB", "", text)


def test_warnings_come_after_validation(ck: Path, tmp_path: Path, cli) -> None:
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "x").write_text("x")
    result = cli("consolidate", ck, dst, "--format", "megatron", code=2)
    assert "warning:" not in result.stderr
    result = cli("consolidate", ck, tmp_path / "full", "--format", "megatron")
    assert "vocabulary padding recomputed" in result.stderr and "RNG state" in result.stderr


def test_verify_against_reports_nan_on_one_side(ck: Path, tmp_path: Path, cli) -> None:
    from safetensors.torch import load_file, save_file

    cli("consolidate", ck, tmp_path / "hf")
    nan = tmp_path / "nan"
    nan.mkdir()
    shutil.copy(tmp_path / "hf/config.json", nan)
    tensors = load_file(tmp_path / "hf/model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[7] = float("nan")
    save_file(tensors, nan / "model.safetensors")
    for tolerance in ([], ["--atol", "1"]):
        args = ("verify", nan, "--against", tmp_path / "hf", *tolerance, "--json")
        report = json.loads(cli(*args, code=1).stdout)
        assert not report["ok"]
        detail = report["checks"][-1]["detail"]
        assert "1 elements are NaN on one side only" in detail
        bad = [t for t in report["tensors"] if not t["equal"]]
        assert [t["nan_mismatch"] for t in bad] == [1]


def test_a_same_layout_reshard_counts_progress_of_copied_files(ck: Path, tmp_path: Path) -> None:
    from ckptctl.io.storage import Storage
    from ckptctl.pipeline.execute import execute
    from ckptctl.pipeline.jobs import plan_reshard

    class Count:
        total = advanced = 0

        def start(self, total_bytes: int, description: str) -> None:
            self.total = total_bytes

        def advance(self, nbytes: int) -> None:
            self.advanced += nbytes

        def finish(self) -> None:
            pass

    job = plan_reshard(str(ck), str(tmp_path / "o"), {"tp": 2, "pp": 2})
    assert job.plan.strategy == "direct"
    progress = Count()
    report = execute(job.plan, job.sources, Storage(str(tmp_path / "o")), progress)
    size = sum(p.stat().st_size for p in ck.rglob("*.pt"))
    assert progress.total == progress.advanced == size > 0
    # Unchanged files move without passing through Python: by the kernel's copy, or written
    # from mapped pages where the file system copies through a pipe (ext4).
    assert len(report.copied) == 1 and sum(report.copied.values()) == size, report.copied


def test_the_demo_says_where_it_wrote_and_keeps_foreign_directories(tmp_path: Path, cli) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    line = one_line_error(cli("demo", "--out", mine, code=2).stderr)
    assert "not empty" in line and (mine / "thesis.tex").exists()


def test_copies_the_kernel_refuses_are_streamed_instead(
    ck: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy_file_range fails across some file systems (EXDEV) or where it is not supported
    (ENOSYS, EOPNOTSUPP): the file is then streamed, byte for byte the same."""
    import errno
    import os

    from ckptctl.io.storage import Storage
    from ckptctl.pipeline.execute import execute
    from ckptctl.pipeline.jobs import plan_reshard

    def refuse(*args: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    monkeypatch.setattr("ckptctl.io.storage.kernel_copy_pays", lambda fd: True)  # even on ext4
    job = plan_reshard(str(ck), str(tmp_path / "o"), {"tp": 2, "pp": 2})
    report = execute(job.plan, job.sources, Storage(str(tmp_path / "o")))
    assert report.copied == {}
    for path in ck.rglob("*.pt"):
        assert (tmp_path / "o" / path.relative_to(ck)).read_bytes() == path.read_bytes()
