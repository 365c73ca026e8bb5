"""Local scale-out proven on one machine: the same job on 1, 2 and 4 simulated nodes, each
bound by its own disk.

Each node is one torchrun process (``--nnodes N --node-rank i``, static rendezvous on
127.0.0.1) in a mount namespace of its own (``unshare -m``), where the job's folder (the same
path on every node, ``--view``) is a bind mount of a folder on the node's own disk: an ext4 file
system in a loop device whose reads and writes the kernel caps at ``--disk`` MB/s each (the
cgroup v1 block-I/O throttle, ``blkio.throttle.read_bps_device`` / ``write_bps_device``, set
on the root group so that the page cache's writeback is held to it as well as reads). Each
disk holds a copy of the source (a node's view of a shared file system through its own link)
and receives the files its node writes; the output is the union of the disks' files. Every
source page is taken out of the page cache before each run, so reads come from the capped
disk. The jobs: reshard a Megatron TP2 PP2 checkpoint with Adam state to TP1 PP4, and
consolidate it to HF safetensors. For each: wall seconds from launch until every node has
exited, the speed-up over one node, whether the output is byte-identical to one node's (every
file's SHA-256), and the cost model's time (``plan --workers N``, the disk measured by
``ckptctl calibrate``).

    sudo python bench/bench_disks.py [--workdir /tmp/ckptctl-bench-disks] [--nodes 1,2,4]
        [--disk 5] [--hidden 1024] [--layers 8] [--jobs reshard,consolidate]

Needs root (loop devices, mounts, the throttle) and cgroup v1's blkio controller.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_nodes import Measured, chosen_jobs, made_source, predicted, print_scaling
from benchlib import compile_bytecode, du, evict, files_of

THROTTLE = Path("/sys/fs/cgroup/blkio")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-disks"))
    parser.add_argument("--view", type=Path, default=Path("/tmp/ckptctl-sim"))
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--disk", type=float, default=5.0, help="MB/s each way, per node")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--jobs", default="reshard,consolidate", help="the jobs to time: reshard, consolidate"
    )
    args = parser.parse_args()
    if os.geteuid() != 0 or not (THROTTLE / "blkio.throttle.read_bps_device").exists():
        sys.exit("bench_disks needs root and cgroup v1's blkio controller (/sys/fs/cgroup/blkio)")
    counts = [int(n) for n in args.nodes.split(",")]
    jobs = chosen_jobs(args.jobs)
    work = args.workdir.resolve()
    src = made_source(work, args.hidden, args.layers)
    compile_bytecode()
    os.environ["CKPTCTL_HOME"] = str(work / "home")  # the calibrated disk, nothing else
    args.view.mkdir(parents=True, exist_ok=True)
    rate = int(args.disk * 1e6)
    with disks(work, max(counts), du(src) * 3 + (256 << 20), src, rate) as mounts:
        calibrate(mounts[0])
        caption = (
            f"source: {du(src) / 1e9:.2f} GB Megatron TP2 PP2 with Adam state, a copy on each "
            f"node's disk (ext4 on a loop device capped at {args.disk:g} MB/s each way by the "
            f"cgroup v1 blkio throttle); each node one torchrun process in its own mount "
            f"namespace; {os.cpu_count()} CPUs shared by all"
        )

        def measure(argv: list[str], n: int, dst: str) -> Measured:
            seconds, report = run_nodes(mounts[:n], args.view, argv, dst)
            digest = union_digests([m / dst for m in mounts[:n]])
            for mount in mounts[:n]:
                shutil.rmtree(mount / dst, ignore_errors=True)
            return seconds, report, digest, predicted(n, argv, str(mounts[0]))

        print_scaling(caption, counts, measure, jobs)


@contextlib.contextmanager
def disks(work: Path, count: int, size: int, src: Path, rate: int) -> Iterator[list[Path]]:
    """``count`` capped disks, each a loop device with an ext4 file system of ``size`` bytes
    holding a copy of ``src``, mounted under ``work``; all undone afterwards."""
    mounted: list[tuple[Path, str]] = []
    try:
        for i in range(count):
            image, mount = work / f"disk{i}.img", work / f"disk{i}"
            with open(image, "wb") as f:
                f.truncate(size)  # sparse: only what is written takes room
            subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
            device = run(["losetup", "--find", "--show", str(image)])
            mount.mkdir(exist_ok=True)
            subprocess.run(["mount", device, str(mount)], check=True)
            mounted.append((mount, device))
            shutil.copytree(src, mount / "src")
        subprocess.run(["sync"], check=True)
        for _, device in mounted:
            cap(device, rate)
        yield [mount for mount, _ in mounted]
    finally:
        for mount, device in mounted:
            cap(device, 0)
            if subprocess.run(["umount", str(mount)], check=False).returncode:
                subprocess.run(["umount", "--lazy", str(mount)], check=False)
            subprocess.run(["losetup", "--detach", device], check=False)
        for i in range(count):
            (work / f"disk{i}.img").unlink(missing_ok=True)


def cap(device: str, rate: int) -> None:
    """Cap ``device``'s reads and writes at ``rate`` bytes per second (0: no cap)."""
    numbers = Path(f"/sys/block/{Path(device).name}/dev").read_text().strip()
    for way in ("read", "write"):
        (THROTTLE / f"blkio.throttle.{way}_bps_device").write_text(f"{numbers} {rate}\n")


def run(command: list[str]) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def run_nodes(
    mounts: list[Path], view: Path, argv: list[str], dst: str
) -> tuple[float, dict[str, Any]]:
    """Seconds from launching a node per disk in ``mounts`` until all have exited, and rank
    0's report (each rank's own job seconds in ``ranks``). Each node sees its disk at
    ``view``; every source page is evicted first."""
    from tests.nodes import free_port, start_node

    for mount in mounts:
        evict(mount / "src")
    filled = [a.format(src=str(view / "src"), dst=str(view / dst)) for a in argv]
    port = free_port()
    started = time.perf_counter()
    nodes = [
        start_node(rank, len(mounts), port, None, filled, own_view(mount, view))
        for rank, mount in enumerate(mounts)
    ]
    outcomes = [node.communicate() for node in nodes]
    seconds = time.perf_counter() - started
    for node, (_, err) in zip(nodes, outcomes, strict=True):
        if node.returncode:
            sys.exit(f"a node failed ({node.returncode}):\n{err[-3000:]}")
    return seconds, json.loads(outcomes[0][0])


def own_view(mount: Path, view: Path) -> list[str]:
    """The command prefix that runs a node in its own mount namespace, ``mount`` seen at
    ``view``."""
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "node",
            str(mount), str(view)]  # fmt: skip


def union_digests(outputs: list[Path]) -> dict[str, str]:
    """Every file the nodes wrote (the union of their disks' outputs), by its path below the
    output: its SHA-256. A file two disks hold differently makes the union unequal to any
    reference. The manifest's timings and the report are left out: they record when and how
    fast, not what was written."""
    out: dict[str, str] = {}
    for output in outputs:
        for path in files_of(output):
            name = str(path.relative_to(output))
            if name.startswith("ckptctl."):
                continue
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            out[name] = digest if out.get(name, digest) == digest else "differs between disks"
    return dict(sorted(out.items()))


def calibrate(mount: Path) -> None:
    """The capped disk as the cost model will know it (``ckptctl calibrate``)."""
    subprocess.run(
        [sys.executable, "-m", "ckptctl", "calibrate", str(mount), "--json"],
        check=True,
        capture_output=True,
    )


if __name__ == "__main__":
    main()
