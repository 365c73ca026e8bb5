"""Scale-out proven on one machine: the same s3 -> s3 job on 1, 2 and 4 simulated nodes.

Each node is one torchrun process (``--nnodes N --node-rank i``, static rendezvous on
127.0.0.1) that reaches the object store (SeaweedFS on 127.0.0.1) only through its own proxy,
which caps the bytes per second it carries in each direction (``--link``, MB/s): the node's
simulated NIC. With links far below what the store and the CPUs can do, the regime is a
cluster's, where each node is bound by its own link and not by a shared CPU. The jobs: reshard
a Megatron TP2 PP2 checkpoint with Adam state to TP1 PP4, and consolidate it to HF safetensors.
For each: wall seconds from launch until every node has exited, the speed-up over one node,
whether the output is byte-identical to one node's (every object's SHA-256, read straight
from the store), and the cost model's time for as many nodes (``plan --workers N``, with the
link measured by ``ckptctl calibrate`` through one proxy).

    python bench/bench_nodes.py [--workdir /tmp/ckptctl-bench-nodes] [--nodes 1,2,4]
        [--link 5] [--hidden 1024] [--layers 8] [--jobs reshard,consolidate]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_s3 import BUCKET, s3_server  # (puts the project root on sys.path, for tests.*)
from benchlib import compile_bytecode, du

HERE = Path(__file__).resolve().parent
JOBS = {
    "reshard TP2 PP2 -> TP1 PP4": ["reshard", "{src}", "{dst}", "--tp", "1", "--pp", "4"],
    "consolidate -> HF": [
        "consolidate", "{src}", "{dst}", "--format", "hf", "--max-shard-size", "24MiB",
    ],
}  # fmt: skip
SHARD = 24 << 20
"""HF shards of 24 MiB: eight of the 0.19 GB of weights, two for each of four nodes (a 1 TB
model in 5 GB shards has 200)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-nodes"))
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--link", type=float, default=5.0, help="MB/s each way, per node")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--server", default="seaweedfs", choices=["seaweedfs", "moto"])
    parser.add_argument("--endpoint-url", help=argparse.SUPPRESS)
    parser.add_argument(
        "--jobs", default="reshard,consolidate", help="the jobs to time: reshard, consolidate"
    )
    args = parser.parse_args()
    jobs = chosen_jobs(args.jobs)
    counts = [int(n) for n in args.nodes.split(",")]
    src = made_source(args.workdir, args.hidden, args.layers)
    compile_bytecode()
    os.environ["CKPTCTL_HOME"] = str(args.workdir / "home")  # the calibrated link, nothing else
    link = args.link * 1e6
    with s3_server(args) as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        import s3fs

        store = s3fs.S3FileSystem(skip_instance_cache=True)
        store.put(str(src), f"{BUCKET}/src", recursive=True)
        calibrate(endpoint, link)
        caption = (
            f"source: {du(src) / 1e9:.2f} GB Megatron TP2 PP2 with Adam state on SeaweedFS "
            f"(127.0.0.1); each node one torchrun process reaching it through its own proxy "
            f"capped at {args.link:g} MB/s each way; {os.cpu_count()} CPUs shared by all"
        )

        def measure(argv: list[str], n: int, dst: str) -> Measured:
            seconds, report = run_nodes(endpoint, link, n, argv, dst)
            return seconds, report, digests(store, f"{BUCKET}/{dst}"), predicted(n, argv)

        print_scaling(caption, counts, measure, jobs)


def chosen_jobs(names: str) -> dict[str, list[str]]:
    """``--jobs``: the jobs of ``JOBS`` to time, by their first word (e.g. the consolidate
    alone, on a source large enough that its transfer, not the simulation's start-up, is what
    is timed)."""
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    jobs = {title: argv for title, argv in JOBS.items() if title.split()[0] in wanted}
    if len(jobs) != len(wanted):
        sys.exit(f"--jobs {names}: choose from {', '.join(t.split()[0] for t in JOBS)}")
    return jobs


def made_source(workdir: Path, hidden: int, layers: int) -> Path:
    """The benches' Megatron TP2 PP2 checkpoint with Adam state, ``workdir/src-h<hidden>-
    l<layers>``: made once for each shape (``examples/make_checkpoint.py``), kept for later
    runs (one folder for every shape gave a run the size of an earlier one)."""
    src = workdir / f"src-h{hidden}-l{layers}"
    if not src.exists():  # made aside and renamed: an interrupted run leaves no half source
        workdir.mkdir(parents=True, exist_ok=True)
        partial = workdir / f"{src.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run(
            [sys.executable, str(HERE.parent / "examples/make_checkpoint.py"),
             "--out", str(partial),
             "--tp", "2", "--pp", "2", "--hidden", str(hidden), "--ffn", str(hidden),
             "--heads", "16", "--kv-heads", "4", "--layers", str(layers)],
            check=True,
        )  # fmt: skip
        partial.rename(src)
    return src


Measured = tuple[float, dict[str, Any], dict[str, str], float]
"""A job on N nodes: wall seconds, rank 0's report, its output's digests, the model's seconds."""


def print_scaling(
    caption: str,
    counts: list[int],
    measure: Callable[[list[str], int, str], Measured],
    jobs: dict[str, list[str]] = JOBS,
) -> None:
    """The table of every job in ``jobs`` on each count of nodes, as ``measure(argv, n,
    output name)`` finds it: speed-up over one node, the slowest rank, start-up, the largest
    share, bytes read against the plan's, the output against one node's, the cost model."""
    print(f"\n{caption}\n")
    print(
        "| job | nodes | seconds | speed-up | per node (ideal N) | slowest rank's job s "
        "| start-up, rendezvous, planning s | largest share | read / planned "
        "| output as 1 node's | model: seconds | model vs slowest rank's job | model vs wall |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for title, argv in jobs.items():
        one, reference = None, None
        for n in counts:
            seconds, report, digest, model = measure(argv, n, f"{title.split()[0]}-{n}")
            slowest, largest, read = rank_figures(report)
            one = one or seconds
            reference = reference or digest
            same = "yes" if digest == reference else "**no**"
            print(
                f"| {title} | {n} | {seconds:.1f} | {one / seconds:.2f}x "
                f"| {one / seconds / n:.2f} | {slowest:.1f} | {seconds - slowest:.1f} "
                f"| {largest:.2f} | {read:.2f}x | {same} | {model:.1f} "
                f"| {model / slowest:.2f} | {model / seconds:.2f} |",
                flush=True,
            )


def rank_figures(report: dict[str, Any]) -> tuple[float, float, float]:
    """From a job's report: the slowest rank's job seconds, the largest rank's part of the
    bytes written (1/N is an even split), and the source bytes all ranks read (for record
    checks too) against the bytes the plan reads: what keeps N nodes from N times the speed."""
    ranks = report.get("ranks")
    if not ranks:
        read = report["bytes_read"] + report["read_for_record_checks"]["bytes"]
        return report["seconds"], 1.0, read / report["estimates"]["bytes_read"]
    slowest = max(r["seconds"] for r in ranks)
    largest = max(r["bytes_written"] for r in ranks) / max(report["bytes_written"], 1)
    read = sum(r["bytes_read"] for r in ranks) / report["estimates"]["bytes_read"]
    return slowest, largest, read


def filled(argv: list[str], dst: str) -> list[str]:
    return [a.format(src=f"s3://{BUCKET}/src", dst=f"s3://{BUCKET}/{dst}") for a in argv]


def run_nodes(
    endpoint: str, link: float, n: int, argv: list[str], dst: str
) -> tuple[float, dict[str, Any]]:
    """Seconds from launching ``n`` nodes until all have exited (each through its own link),
    and rank 0's report (each rank's own job seconds in ``ranks``)."""
    from tests.nodes import free_port, start_node
    from tests.s3proxy import S3Proxy

    proxies = [S3Proxy(endpoint, link=link).start() for _ in range(n)]
    port = free_port()
    started = time.perf_counter()
    try:
        nodes = [
            start_node(rank, n, port, proxy.url, filled(argv, dst))
            for rank, proxy in enumerate(proxies)
        ]
        outcomes = [node.communicate() for node in nodes]
        seconds = time.perf_counter() - started
    finally:
        for proxy in proxies:
            proxy.stop()
    for node, (_, err) in zip(nodes, outcomes, strict=True):
        if node.returncode:
            sys.exit(f"a node failed ({node.returncode}):\n{err[-3000:]}")
    return seconds, json.loads(outcomes[0][0])


def digests(store: object, prefix: str) -> dict[str, str]:
    """Every object under ``prefix``, by its path below it: its SHA-256 (read from the store
    directly, not through a link). The manifest's timings and the report are left out: they
    record when and how fast, not what was written."""
    out = {}
    for path in sorted(store.find(prefix)):  # type: ignore[attr-defined]
        name = path[len(prefix) + 1 :]
        if name.startswith("ckptctl."):
            continue
        out[name] = hashlib.sha256(store.cat_file(path)).hexdigest()  # type: ignore[attr-defined]
    return out


def calibrate(endpoint: str, link: float) -> None:
    """The link as the cost model will know it: ``ckptctl calibrate`` through one proxy."""
    from tests.s3proxy import S3Proxy

    proxy = S3Proxy(endpoint, link=link).start()
    try:
        subprocess.run(
            [sys.executable, "-m", "ckptctl", "calibrate", f"s3://{BUCKET}", "--json"],
            check=True,
            capture_output=True,
            env={**os.environ, "AWS_ENDPOINT_URL": proxy.url},
        )
    finally:
        proxy.stop()


def predicted(n: int, argv: list[str], root: str = f"s3://{BUCKET}") -> float:
    """The cost model's seconds for ``n`` nodes, each with its own link or disk (what ``plan
    --workers`` reports), for the job ``argv`` on the source under ``root``, planned on the
    calibrated storage."""
    from ckptctl.cli.plan import worker_shares
    from ckptctl.pipeline.jobs import plan_consolidate, plan_reshard

    src, dst = f"{root}/src", f"{root}/planned"
    if argv[0] == "reshard":
        job = plan_reshard(src, dst, {"tp": 1, "pp": 4})
    else:
        job = plan_consolidate(src, dst, "hf", max_shard_bytes=SHARD)
    model = worker_shares(job, max(n, 2))
    return float(model["seconds_one_node_each"] if n > 1 else model["seconds_one_process"])


if __name__ == "__main__":
    main()
