"""One job per destination: a second job on a destination another is writing is refused while
the first holds ``ckptctl.lock``, and nothing is marked complete unless every file matches
the manifest; a killed job's lock is taken over once stale. Locally and on S3 (moto)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptctl import synth
from ckptctl.io.storage import Storage
from ckptctl.pipeline.lease import LOCK, DestinationBusyError, Lease
from tests.io import test_s3

s3_endpoint, bucket = test_s3.s3_endpoint, test_s3.bucket  # moto's S3 server fixtures


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = synth.tiny_llama_config(
        hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=4, num_layers=8
    )
    model = synth.make_model(config, seed=4)
    out = tmp_path_factory.mktemp("one-writer") / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=4), out, tp=2, pp=2)
    return out


def _start(source: Path, out: Path | str, *extra: str) -> subprocess.Popen:
    argv = ["reshard", str(source), str(out), "--tp", "1", "--pp", "4", "--json", *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "ckptctl", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_second_job_is_refused_while_the_first_holds_the_destination(
    source: Path, tmp_path: Path, cli
) -> None:
    out = tmp_path / "out"
    first = Lease(Storage(str(out)))  # a job writing out, as this process
    first.acquire()
    try:
        second = cli("reshard", source, out, "--tp", "1", "--pp", "4", code=2)
        assert "is being written by another ckptctl job" in second.stderr
        assert f"pid {os.getpid()}" in second.stderr
        assert set(os.listdir(out)) == {LOCK}  # the refused job touched nothing
    finally:
        first.release()
    cli("reshard", source, out, "--tp", "1", "--pp", "4")
    assert not (out / LOCK).exists()
    assert cli.json("verify", out)["ok"]
    # Finished: the same job again has nothing to do; the lock is taken and given back.
    again = cli.json("reshard", source, out, "--tp", "1", "--pp", "4")
    assert again["files"] == [] and not (out / LOCK).exists()


@pytest.mark.parametrize("attempt", range(3))
def test_two_jobs_started_together_never_corrupt_the_output(
    source: Path, tmp_path: Path, cli, attempt: int
) -> None:
    """Before the lock, one of two such jobs exited 4 and the other left the destination
    marked complete with a file that did not match the manifest (3 of 14 tries)."""
    out = tmp_path / "out"
    jobs = [_start(source, out) for _ in range(2)]
    codes = [job.wait(timeout=300) for job in jobs]
    errors = [job.communicate()[1] for job in jobs]
    assert sorted(codes) in ([0, 0], [0, 2]), (codes, errors)
    for code, err in zip(codes, errors, strict=True):
        if code == 2:
            assert "is being written by another ckptctl job" in err
    assert cli.json("verify", out, "--against", source)["ok"]
    assert not list(out.rglob("*.partial")) and not (out / LOCK).exists()


def _lock(storage: Storage, **fields: object) -> None:
    body = {
        "token": "other",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "renewed": time.time(),
        "lease_seconds": 120.0,
        **fields,
    }
    storage.write_text(LOCK, json.dumps(body))


def test_a_killed_jobs_lock_is_taken_over_once_stale(source: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "out"
    storage = Storage(str(out))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    _lock(storage, pid=int(dead.stdout))  # this machine, a process that is gone
    cli("reshard", source, out, "--tp", "1", "--pp", "4")
    assert not (out / LOCK).exists() and cli.json("verify", out)["ok"]
    other = tmp_path / "other"
    _lock(Storage(str(other)), host="elsewhere", renewed=time.time() - 1000)  # not renewed
    cli("reshard", source, other, "--tp", "1", "--pp", "4")


def test_a_live_lock_elsewhere_is_respected(source: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "out"
    _lock(Storage(str(out)), host="elsewhere")
    result = cli("reshard", source, out, "--tp", "1", "--pp", "4", code=2)
    assert "on elsewhere" in result.stderr
    assert json.loads((out / LOCK).read_text())["token"] == "other"  # left as it was


def test_the_lease_is_renewed_while_held(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "d"))
    lease = Lease(storage, lease=0.4)
    lease.acquire()
    try:
        first = json.loads(storage.read_text(LOCK))["renewed"]
        deadline = time.monotonic() + 30
        while json.loads(storage.read_text(LOCK))["renewed"] == first:
            assert time.monotonic() < deadline, "never renewed"
            time.sleep(0.05)
        with pytest.raises(DestinationBusyError):
            Lease(storage).acquire()  # held and renewed: live, whatever its age
    finally:
        lease.release()
    assert not storage.exists(LOCK)


def test_on_s3_a_second_job_is_refused(source: Path, bucket: str, cli) -> None:
    """The second job would have aborted the first's multipart uploads as a killed run's
    leftovers: it is refused before it touches anything."""
    url = f"{bucket}/out"
    first = Lease(Storage(url))
    first.acquire()
    try:
        second = cli("reshard", source, url, "--tp", "1", "--pp", "4", code=2)
        assert "is being written by another ckptctl job" in second.stderr
    finally:
        first.release()
    cli("reshard", source, url, "--tp", "1", "--pp", "4")
    assert not Storage(url).exists(LOCK)
    assert cli.json("verify", url)["ok"]


def test_on_s3_the_lock_is_taken_atomically(bucket: str) -> None:
    storage = Storage(f"{bucket}/atomic")
    held = Lease(storage)
    held.acquire()
    try:
        with pytest.raises(DestinationBusyError):
            Lease(storage).acquire()
    finally:
        held.release()
    again = Lease(storage)
    again.acquire()
    again.release()
