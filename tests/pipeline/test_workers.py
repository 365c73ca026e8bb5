"""One job on several processes (``--workers K``, torchrun's environment, gloo): shares of the
target files balanced by bytes, outputs byte-identical to one process, one commit by rank 0,
no manifest when a rank dies and a rerun that completes, plans that differ refused."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptctl import synth
from ckptctl.checksums.manifest import INCOMPLETE, MANIFEST
from ckptctl.formats.megatron_common.target import MEGATRON_RANK
from ckptctl.model.plan import CopyOp, FileWrite, TensorWrite
from planners.shares import parallel_seconds, share_bytes, split_files
from tests.io import test_s3
from tests.nodes import free_port, start_node
from tests.pipeline.test_reshard import assert_same_checkpoint
from tests.s3proxy import S3Proxy

s3_endpoint, bucket = test_s3.s3_endpoint, test_s3.bucket  # moto's S3 server fixtures

# --- shares (pure) ------------------------------------------------------------------------------


def _file(path: str, sources: list[int]) -> FileWrite:
    copies = tuple(
        CopyOp(source=s, key=("w",), src=(0,), dst=(i,), sizes=(1,)) for i, s in enumerate(sources)
    )
    tensor = TensorWrite(
        key=("w",), canonical="w", shape=(len(sources),), dtype="float32", copies=copies
    )
    return FileWrite(path=path, kind=MEGATRON_RANK, tensors=(tensor,))


def test_shares_cover_every_file_once_and_balance_bytes() -> None:
    sizes = [90, 10, 40, 40, 30, 30, 20, 20, 10, 10]
    files = [_file(f"f{i}", [i]) for i in range(len(sizes))]
    for ranks in (1, 2, 3, 4, 16):
        shares = split_files(files, sizes, ranks)
        assert len(shares) == ranks
        assert sorted(i for share in shares for i in share) == list(range(len(files)))
        assert all(list(share) == sorted(share) for share in shares)  # plan order kept
        loads = share_bytes(sizes, shares)
        # no share above an even split, or the largest file where that alone is more
        assert max(loads) <= max(sum(sizes) / ranks * 1.05, max(sizes)) + max(sizes) / 2
    assert share_bytes(sizes, split_files(files, sizes, 2)) == (150, 150)
    assert split_files(files, sizes, 3) == split_files(files, sizes, 3)  # every rank agrees


def test_shares_keep_files_near_the_sources_they_read() -> None:
    # Two groups of files, each reading its own sources: equal sizes, so locality decides.
    files = [_file(f"a{i}", [0, 1]) for i in range(2)] + [_file(f"b{i}", [2, 3]) for i in range(2)]
    shares = split_files(files, [10, 10, 10, 10], 2)
    assert sorted(shares) == [(0, 1), (2, 3)]


def test_shares_refuse_no_ranks() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        split_files([], [], 0)


def test_cost_model_speed_up_needs_storage_of_its_own() -> None:
    sizes = [30, 30, 20, 20]
    shares = ((0, 2), (1, 3))
    # one machine: the processes share its disk and NIC, the model's bound
    assert parallel_seconds(10.0, sizes, shares, shared_storage=True) == 10.0
    # a node each: the largest share's part of the time
    assert parallel_seconds(10.0, sizes, shares, shared_storage=False) == 5.0
    assert parallel_seconds(10.0, sizes, ((0, 1, 2), (3,)), shared_storage=False) == 8.0
    # each node fills and drains its own pipeline: that part is not divided
    assert parallel_seconds(10.0, sizes, shares, shared_storage=False, pipeline=2.0) == 6.0
    # ... as long as its share is as large as the window; a smaller one pays for its share
    assert parallel_seconds(10.0, sizes, shares, False, pipeline=2.0, window=50) == 6.0
    assert parallel_seconds(10.0, sizes, shares, False, pipeline=2.0, window=100) == 5.0


def test_plan_shows_each_workers_share(source: Path, tmp_path: Path) -> None:
    done = ckptctl("plan", source, tmp_path / "out", "--tp", "1", "--pp", "4", "--workers", 3,
                   "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    workers = plan["workers"]
    files = [f for s in workers["shares"] for f in s["files"]]
    assert sorted(files) == sorted(f["path"] for f in plan["files"])
    assert workers["seconds_one_machine"] == plan["estimates"]["seconds"]
    assert workers["seconds_one_node_each"] < plan["estimates"]["seconds"]
    text = ckptctl("plan", source, tmp_path / "out", "--tp", "1", "--pp", "4", "--workers", 2)
    assert "on 2 nodes each with its own disk and NIC" in text.stdout


# --- jobs on several processes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workers")
    config = synth.tiny_llama_config(
        hidden_size=128, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=256
    )
    model = synth.make_model(config, seed=5)
    synth.write_megatron(model, synth.adam_step(model, seed=5), str(root / "src"), tp=2, pp=2)
    return root / "src"


def ckptctl(*argv: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptctl", *map(str, argv)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def same_tree(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel


def reference(tmp_path: Path, out: Path, *argv: object) -> Path:
    """``argv``'s output by one process, moved aside so the parallel run writes to the same
    path (the plan, and so the manifest, names its target)."""
    done = ckptctl(*argv)
    assert done.returncode == 0, done.stderr
    ref = tmp_path / "reference"
    out.rename(ref)
    return ref


@pytest.mark.parametrize(
    ("workers", "argv"),
    [
        (2, ["reshard", "--tp", "1", "--pp", "4"]),
        (4, ["reshard", "--tp", "4", "--pp", "2"]),
        (2, ["reshard", "--tp", "2", "--pp", "2", "--format", "torch_dist"]),
        (2, ["consolidate", "--format", "hf", "--max-shard-size", "1MiB"]),
        (3, ["consolidate", "--format", "deepspeed-universal"]),
    ],
)
def test_several_processes_write_what_one_writes(
    workers: int, argv: list[str], source: Path, tmp_path: Path
) -> None:
    command, *options = argv
    out = tmp_path / "out"
    ref = reference(tmp_path, out, command, source, out, *options)
    done = ckptctl(command, source, out, *options, "--workers", workers, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # one document, from rank 0
    assert [r["rank"] for r in report["ranks"]] == list(range(workers))
    assert sum(r["bytes_written"] for r in report["ranks"]) == report["bytes_written"]
    checked = report["read_for_record_checks"]["bytes"]
    assert sum(r["bytes_read"] for r in report["ranks"]) == report["bytes_read"] + checked
    same_tree(ref, out)
    assert not any(p.name.startswith(INCOMPLETE) for p in out.rglob("*"))


def test_ranks_read_and_write_s3_each_with_its_own_connections(
    bucket: str, source: Path, tmp_path: Path
) -> None:
    for argv in (
        ["reshard", source, f"{bucket}/tp1", "--tp", "1", "--pp", "4"],
        ["reshard", f"{bucket}/tp1", tmp_path / "back", "--tp", "2", "--pp", "2"],
    ):
        done = ckptctl(*argv, "--workers", 2)
        assert done.returncode == 0, done.stderr
    checked = json.loads(ckptctl("verify", f"{bucket}/tp1", "--json").stdout)
    assert checked["ok"], checked
    assert_same_checkpoint(source, tmp_path / "back")


def test_verify_on_several_processes_finds_what_one_finds(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert ckptctl("reshard", source, out, "--tp", "1", "--pp", "4").returncode == 0
    one = json.loads(ckptctl("verify", out, "--numerics", "--json").stdout)
    two = ckptctl("verify", out, "--numerics", "--json", "--workers", 2)
    assert two.returncode == 0, two.stderr
    assert one["ok"] and json.loads(two.stdout) == one
    victim = sorted(out.rglob("model_optim_rng.pt"))[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    one = json.loads(ckptctl("verify", out, "--json").stdout)
    two = ckptctl("verify", out, "--json", "--workers", 3)
    assert two.returncode == 1
    assert not one["ok"] and json.loads(two.stdout) == one
    assert "checksum differs from the manifest" in json.dumps(one)


def test_torchrun_runs_one_job(source: Path, tmp_path: Path) -> None:
    """torch's own launcher (``torchrun --standalone``): its environment is all ckptctl needs."""
    out = tmp_path / "out"
    ref = reference(tmp_path, out, "reshard", source, out, "--tp", "1", "--pp", "4")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ckptctl", "reshard", str(source), str(out), "--tp", "1", "--pp", "4", "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["rank"] for r in json.loads(done.stdout)["ranks"]] == [0, 1]  # one document
    same_tree(ref, out)


def _fetch(url: str, into: Path) -> Path:
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).get(
        url.removeprefix("s3://"), str(into), recursive=True
    )
    return into


def test_nodes_each_through_their_own_endpoint_write_what_one_process_writes(
    s3_endpoint: str, bucket: str, source: Path, tmp_path: Path
) -> None:
    """Two torchrun nodes (``--nnodes 2 --node-rank i``, one process each), each reaching the
    store only through its own endpoint (a proxy in front of it, as nodes of a cluster each
    have their own gateway or NIC): the same plan on both, and the output one process writes."""
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).put(str(source), "lake/src", recursive=True)
    argv = ["reshard", f"{bucket}/src", f"{bucket}/out", "--tp", "1", "--pp", "4"]
    done = ckptctl(*argv)
    assert done.returncode == 0, done.stderr
    ref = _fetch(f"{bucket}/out", tmp_path / "reference")
    s3fs.S3FileSystem(skip_instance_cache=True).rm("lake/out", recursive=True)
    proxies = [S3Proxy(s3_endpoint).start() for _ in range(2)]
    port = free_port()
    try:
        nodes = [start_node(rank, 2, port, proxy.url, argv) for rank, proxy in enumerate(proxies)]
        outcomes = [node.communicate(timeout=600) for node in nodes]
    finally:
        for proxy in proxies:
            proxy.stop()
    for node, (_, err) in zip(nodes, outcomes, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert [r["rank"] for r in json.loads(outcomes[0][0])["ranks"]] == [0, 1]
    for proxy in proxies:  # each node read its share and wrote its files through its own
        assert proxy.gets("lake/src/"), proxy.url
        assert any(
            r.method in ("PUT", "POST") and r.key.startswith("lake/out/") for r in proxy.requests
        )
    same_tree(ref, _fetch(f"{bucket}/out", tmp_path / "nodes"))


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    for pid in children.read_text().split() if children.exists() else ():
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return int(pid)
    return None


def test_a_killed_rank_leaves_no_manifest_and_the_rerun_completes(
    source: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = ["reshard", source, out, "--tp", "1", "--pp", "4"]
    ref = reference(tmp_path, out, *argv)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ckptctl", *map(str, argv), "--workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not (out / f"{INCOMPLETE}.rank1").exists():  # rank 1 has started writing
        assert launcher.poll() is None and time.monotonic() < deadline, "rank 1 never started"
        time.sleep(0.01)
    pid = _rank_pid(launcher, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert launcher.wait(60) != 0
    assert not (out / MANIFEST).exists()
    assert (out / INCOMPLETE).exists()
    # the same command again, on another number of processes (rank 0 takes in every log)
    done = ckptctl(*argv, "--workers", "3")
    assert done.returncode == 0, done.stderr
    same_tree(ref, out)


def test_ranks_that_plan_different_jobs_are_refused(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "ckptctl", "reshard", str(source), str(out), "--tp", "1",
             "--pp", pp],
            env={**os.environ, **env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, pp in ((0, "4"), (1, "2"))
    ]  # fmt: skip
    for proc in ranks:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert "the ranks planned different jobs" in err
        assert "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_nodes_reading_copies_of_the_source_agree_on_the_plan(source: Path, tmp_path: Path) -> None:
    """A node may read the checkpoint from a copy of its own (``rsync -a`` to its disk): the
    ranks agree on a plan from a copy that keeps its files' sizes and modification times,
    though its inodes and change times differ; an output's fingerprint (what a rerun checks)
    still tells the copies apart, and a copy whose times were not kept is another job."""
    from ckptctl.pipeline.jobs import plan_reshard

    here, out = tmp_path / "src", str(tmp_path / "out")
    shutil.copytree(source, here)
    first = plan_reshard(str(here), out, {"tp": 1}).plan
    shutil.move(here, tmp_path / "aside")
    shutil.copytree(tmp_path / "aside", here)  # copy2: sizes and modification times kept
    copy = plan_reshard(str(here), out, {"tp": 1}).plan
    assert copy.shared_fingerprint() == first.shared_fingerprint()
    assert copy.fingerprint() != first.fingerprint()
    assert copy.files == first.files
    newest = max(f for f in here.rglob("*.pt"))
    os.utime(newest, ns=(newest.stat().st_atime_ns, newest.stat().st_mtime_ns + 1))
    touched = plan_reshard(str(here), out, {"tp": 1}).plan
    assert touched.shared_fingerprint() != first.shared_fingerprint()


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
