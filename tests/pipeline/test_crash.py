"""Crash safety: a reshard killed with SIGKILL at random points never leaves an output marked
complete that fails verify, and rerunning the same command resumes and ends byte-identical to an
uninterrupted run."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptctl import synth


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = synth.tiny_llama_config(
        hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4, num_layers=8
    )
    model = synth.make_model(config, seed=3)
    out = tmp_path_factory.mktemp("crash") / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=3), out, tp=2, pp=2)
    return out


def _reshard(source: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptctl",
            "reshard",
            str(source),
            str(out),
            "--tp",
            "1",
            "--pp",
            "4",
            "--memory-budget",
            "1MiB",
            "--json",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _files(out: Path) -> dict[str, str]:
    return json.loads((out / "ckptctl.manifest.json").read_text())["files"]


def _crash_and_resume(
    source: Path, tmp_path: Path, kills: int, seed: int, extra: tuple[str, ...] = ()
) -> None:
    reference = tmp_path / "reference"
    assert _reshard(source, reference, *extra).wait(timeout=300) == 0
    started = time.perf_counter()
    _reshard(source, tmp_path / "timing", *extra).wait(timeout=300)
    duration = time.perf_counter() - started
    rng = random.Random(seed)
    out = tmp_path / "out"
    for _ in range(kills):
        job = _reshard(source, out, *extra)
        time.sleep(rng.uniform(0.05, duration))
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
        if (out / "ckptctl.manifest.json").exists():
            verify = subprocess.run(
                [sys.executable, "-m", "ckptctl", "verify", str(out)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert verify.returncode == 0, verify.stdout + verify.stderr
        else:
            assert not (out / "ckptctl.manifest.json").exists()
    assert _reshard(source, out, *extra).wait(timeout=300) == 0
    assert _files(out) == _files(reference)
    for path in _files(reference):
        assert (out / path).read_bytes() == (reference / path).read_bytes(), path
    assert not list(out.rglob("*.partial"))


def test_killed_reshard_resumes_byte_identical(source: Path, tmp_path: Path) -> None:
    _crash_and_resume(source, tmp_path, kills=1, seed=1)


def test_killed_torch_dist_reshard_resumes_byte_identical(source: Path, tmp_path: Path) -> None:
    """DCP output: .metadata is built from the records of every shard, rewritten or reused."""
    _crash_and_resume(source, tmp_path, kills=2, seed=5, extra=("--format", "torch_dist"))


@pytest.mark.slow
def test_killed_reshard_at_ten_random_points(source: Path, tmp_path: Path) -> None:
    _crash_and_resume(source, tmp_path, kills=10, seed=2)


def test_the_run_log_is_saved_every_second_not_after_every_file(
    source: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job of many small files (DeepSpeed universal: four per parameter) rewrites its
    in-progress log about once a second, not once per file; what it logged is reused by a
    rerun after a failure, and the files it had not logged yet are written again."""
    from ckptctl.checksums import manifest
    from ckptctl.io.storage import Storage

    saved: list[dict] = []
    write_text = Storage.write_text

    def spy(self: Storage, rel: str, text: str) -> None:
        if rel == manifest.INCOMPLETE:
            saved.append(json.loads(text))
        write_text(self, rel, text)

    monkeypatch.setattr(Storage, "write_text", spy)
    out = tmp_path / "universal"
    started = time.monotonic()
    report = cli.json("consolidate", source, out, "--format", "deepspeed-universal")
    elapsed = time.monotonic() - started
    files = len(report["files"])
    assert files > 50
    assert 1 <= len(saved) <= 2 + elapsed / manifest.SAVE_EVERY < files / 4

    # A failure at the 20th file, the log saved after every file: the rerun keeps the 19.
    monkeypatch.setattr(manifest, "SAVE_EVERY", 0.0)
    open_write = Storage.open_write
    opened: list[str] = []

    def failing(self: Storage, rel: str, digest=None):  # type: ignore[no-untyped-def]
        if rel.endswith(".pt"):
            opened.append(rel)
            if len(opened) == 20:
                raise OSError(28, "No space left on device", rel)
        return open_write(self, rel, digest)

    again = tmp_path / "again"
    monkeypatch.setattr(Storage, "open_write", failing)
    # One file at a time: with more, the file opened just before the 20th may still be in
    # flight when the failure stops the job (and is written again by the rerun).
    one = ("--files-at-once", "1")
    cli("consolidate", source, again, "--format", "deepspeed-universal", *one, code=4)
    monkeypatch.setattr(Storage, "open_write", open_write)
    kept = {rel: (again / rel).stat().st_mtime_ns for rel in opened[:19]}
    time.sleep(0.01)
    cli("consolidate", source, again, "--format", "deepspeed-universal")
    assert {rel: (again / rel).stat().st_mtime_ns for rel in kept} == kept
    for rel in _files(out):
        assert (again / rel).read_bytes() == (out / rel).read_bytes(), rel
