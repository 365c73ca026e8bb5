"""A Megatron checkpoint larger than the memory its runs have, through a real S3 server:
ckptctl against s3fs moving the same bytes, in one run, every direction.

Generates the checkpoint of ``bench_large.py`` (Megatron legacy TP2 PP2, bf16 weights and Adam
state; 4 layers at hidden 4096 make 13.6 GB, 10 layers 28.5 GB; written rank file by rank file,
never whole in memory) into ``--workdir`` and starts SeaweedFS (127.0.0.1, data on the same
disk). Every timed run is a fresh process in a memory cgroup of its own (cgroup v1,
``memory.limit_in_bytes`` = ``--memory-limit``, 4 GiB by default): the page cache it fills is
charged to it too, so a checkpoint several times the limit is one larger than the run's RAM,
however much the machine has (``--memory-limit none`` runs on the whole machine and then needs
a checkpoint larger than its RAM; this machine's disk cannot hold SeaweedFS's copies of 28.5
GB). Each run starts after ``sync`` and emptying the page cache; its time includes a final
``sync``:

* local -> s3: ``ckptctl reshard`` (TP1, ``--pp``) into the store, then s3fs uploading the
  source (which becomes the store's copy of it);
* s3 -> s3: s3fs copying every object (read and written by the client) and ``ckptctl
  reshard``;
* s3 -> local: s3fs downloading every object and ``ckptctl reshard`` to the disk.

The s3fs runs stream each object in 8 MiB blocks through ``S3FileSystem.open`` (its
``put``/``get`` read whole files into memory, more than a memory-limited run has). ckptctl runs
under ``--memory-budget``; the table shows each run's peak RSS and whether ckptctl kept to the
budget + 300 MiB. The disk holds two copies of the checkpoint at a time, not three: each output
is deleted (and the store's space reclaimed) after its run, and the local source once it is in
the store (the bench generates it again next time).

    sudo python bench/bench_s3_large.py [--workdir /tmp/ckptctl-bench-s3-large] [--layers 4]
        [--memory-limit 4GiB] [--budget 1GiB] [--pp 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from bench_large import generate, memory_bytes
from bench_s3 import BUCKET, s3_server  # (puts the project root on sys.path)
from benchlib import check_free_space, compile_bytecode, drop_caches, du, remove, timed

Row = tuple[str, str, float, int]
"""(run, direction, seconds, peak RSS bytes)."""

MEMORY = Path("/sys/fs/cgroup/memory")

STREAM = r"""
import os, sys
import s3fs
mode, *argv = sys.argv[1:]
fs = s3fs.S3FileSystem()
BLOCK = 8 << 20

def pour(r, w):
    while block := r.read(BLOCK):
        w.write(block)

if mode == "copy":  # s3 -> s3: every object read and written by the client
    src, dst = argv
    for key in fs.find(src):
        with fs.open(key, "rb", block_size=BLOCK) as r, \
             fs.open(dst + key[len(src):], "wb", block_size=BLOCK) as w:
            pour(r, w)
elif mode == "get":  # s3 -> local
    src, dst = argv
    for key in fs.find(src):
        path = dst + key[len(src):]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with fs.open(key, "rb", block_size=BLOCK) as r, open(path, "wb") as w:
            pour(r, w)
    os.sync()
elif mode == "put":  # local -> s3
    src, dst = argv
    for root, _, names in os.walk(src):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as r, \
                 fs.open(dst + path[len(src):], "wb", block_size=BLOCK) as w:
                pour(r, w)
elif mode == "rm":
    fs.rm(argv[0], recursive=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-s3-large"))
    parser.add_argument("--memory-limit", default="4GiB", help="Each run's memory, or 'none'.")
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--pp", type=int, default=2, help="The reshard's target PP (TP1).")
    parser.add_argument("--allow-smaller", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--server", default="seaweedfs", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    limit = memory_bytes() if args.memory_limit == "none" else parse_size(args.memory_limit)
    work = args.workdir.resolve()
    src = work / f"src-l{args.layers}-h{args.hidden}"
    if not src.exists():
        work.mkdir(parents=True, exist_ok=True)
        generate(src, args)
    size = du(src)
    if size <= limit and not args.allow_smaller:
        sys.exit(f"{src}: {size / 1e9:.1f} GB fits in {limit / 2**30:.1f} GiB; raise --layers")
    check_free_space(work, size)  # the source is here: room for one more copy
    compile_bytecode()
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    args.workdir = work  # s3_server keeps SeaweedFS's data here
    limited = None if args.memory_limit == "none" else limit
    with memory_group(limited) as group, s3_server(args) as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        rows = run_all(src, work, args, group)
    where = (
        f"each run in a memory cgroup of {limit / 2**30:.0f} GiB (page cache included)"
        if group
        else f"a machine with {memory_bytes() / 1e9:.1f} GB of RAM"
    )
    print(
        f"\nsource: {size / 1e9:.1f} GB Megatron TP2 PP2 (bf16, Adam state), {where}; SeaweedFS "
        "on 127.0.0.1 (its data on the same disk); page cache emptied before each run; times "
        "include a final sync\n"
    )
    print(
        "| run | direction | seconds | GB/s | vs s3fs, same direction | peak RSS "
        f"| within {args.budget} + 300 MiB |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    baseline = {direction: t for name, direction, t, _ in rows if name.startswith("s3fs")}
    most = parse_size(args.budget) + (300 << 20)
    for name, direction, seconds, rss in rows:
        within = "-" if name.startswith("s3fs") else ("yes" if rss <= most else "**no**")
        print(
            f"| {name} | {direction} | {seconds:.0f} | {size / seconds / 1e9:.3f} "
            f"| {baseline[direction] / seconds:.2f}x | {rss / 2**20:.0f} MiB | {within} |"
        )


@contextlib.contextmanager
def memory_group(limit: int | None) -> Iterator[Path | None]:
    """A cgroup v1 memory group of ``limit`` bytes (page cache included) for the timed runs;
    None: no limit."""
    if limit is None:
        yield None
        return
    if os.geteuid() != 0 or not (MEMORY / "memory.limit_in_bytes").exists():
        sys.exit("--memory-limit needs root and cgroup v1's memory controller; or pass 'none'")
    group = MEMORY / f"ckptctl-bench-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (MEMORY / "cgroup.procs").write_text(pid)
        group.rmdir()


def inside(group: Path | None, cmd: list[str]) -> list[str]:
    """``cmd`` run in ``group`` (the shell moves itself in, then becomes the command)."""
    if group is None:
        return cmd
    return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "run", *cmd]


def run_all(src: Path, work: Path, args: argparse.Namespace, group: Path | None) -> list[Row]:
    """Every run, in an order that never needs three copies on the disk."""
    from tests.seaweedfs import vacuum

    s3, bucket = f"s3://{BUCKET}", BUCKET
    target = ["--tp", "1", "--pp", str(args.pp), "--memory-budget", args.budget, "--json"]
    ckptctl = [sys.executable, "-m", "ckptctl", "reshard"]
    stream = [sys.executable, "-c", STREAM]
    rows: list[Row] = []

    def time_it(name: str, direction: str, cmd: list[str], after: Callable[[], None]) -> None:
        drop_caches()
        timing = timed(inside(group, cmd), prime=False)
        rows.append((name, direction, timing.seconds, timing.rss))
        print(f"{name} {direction}: {timing.seconds:.0f} s", file=sys.stderr, flush=True)
        after()

    def delete(prefix: str) -> Callable[[], None]:
        def after() -> None:
            subprocess.run([*stream, "rm", f"{bucket}/{prefix}"], check=True)
            vacuum(work / "seaweedfs")

        return after

    # Each output under a name of its own: SeaweedFS lists a deleted prefix for a while.
    time_it(
        "ckptctl reshard", "local->s3", [*ckptctl, str(src), f"{s3}/out1", *target], delete("out1")
    )
    time_it("s3fs upload", "local->s3", [*stream, "put", str(src), f"{bucket}/src"], lambda: None)
    remove(src)  # the store's copy is the source from here on
    time_it(
        "s3fs copy (client-side)",
        "s3->s3",
        [*stream, "copy", f"{bucket}/src", f"{bucket}/copy"],
        delete("copy"),
    )
    time_it(
        "ckptctl reshard", "s3->s3", [*ckptctl, f"{s3}/src", f"{s3}/out2", *target], delete("out2")
    )
    time_it(
        "s3fs download (+ sync)",
        "s3->local",
        [*stream, "get", f"{bucket}/src", str(work / "got")],
        lambda: shutil.rmtree(work / "got"),
    )
    time_it(
        "ckptctl reshard",
        "s3->local",
        [*ckptctl, f"{s3}/src", str(work / "out"), *target],
        lambda: shutil.rmtree(work / "out"),
    )
    return rows  # fmt: skip


def parse_size(text: str) -> int:
    from ckptctl.cli.options import parse_size as parse

    return int(parse(text))


if __name__ == "__main__":
    main()
