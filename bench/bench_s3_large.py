"""A Megatron checkpoint larger than RAM through a real S3 server: ckptctl against s3fs moving
the same bytes, in one run, every direction.

Generates the checkpoint of ``bench_large.py`` (Megatron legacy TP2 PP2, bf16 weights and Adam
state; 10 layers at hidden 4096 make 28.5 GB; written rank file by rank file, never whole in
memory) into ``--workdir``, starts SeaweedFS (127.0.0.1, data on the same disk) and times,
each run a fresh process started after ``sync`` and emptying the page cache (root), its time
including a final ``sync``:

* local -> s3: ``ckptctl reshard`` (TP1 PP5) into the store, then ``s3fs put`` of the source
  (which becomes the store's copy of it);
* s3 -> s3: a plain s3fs copy (every object read and written by the client in 8 MiB blocks:
  the data path a reshard must take) and ``ckptctl reshard`` (TP1 PP5);
* s3 -> local: ``s3fs get`` and ``ckptctl reshard`` (TP1 PP5) to the disk.

ckptctl runs under ``--memory-budget``; the table shows each run's peak RSS and whether it kept
to the budget + 300 MiB. The disk holds two copies of the checkpoint at a time, not three: each
output is deleted (and the store's space reclaimed) after its run, and the local source once it
is in the store (the bench generates it again next time).

    sudo python bench/bench_s3_large.py [--workdir /tmp/ckptctl-bench-s3-large] [--layers 10]
        [--budget 1GiB]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bench_large import generate, memory_bytes
from bench_s3 import BUCKET, S3FS, s3_server  # (puts the project root on sys.path)
from benchlib import check_free_space, compile_bytecode, drop_caches, du, remove, timed

Row = tuple[str, str, float, int]
"""(run, direction, seconds, peak RSS bytes)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-s3-large"))
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--pp", type=int, default=5, help="The reshard's target PP (TP1).")
    parser.add_argument("--allow-smaller", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--server", default="seaweedfs", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = args.workdir.resolve()
    src = work / f"src-l{args.layers}-h{args.hidden}"
    if not src.exists():
        work.mkdir(parents=True, exist_ok=True)
        generate(src, args)
    size = du(src)
    if size <= memory_bytes() and not args.allow_smaller:
        sys.exit(f"{src}: {size / 1e9:.1f} GB fits in memory; raise --layers")
    check_free_space(work, 2 * size)
    compile_bytecode()
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    args.workdir = work  # s3_server keeps SeaweedFS's data here
    with s3_server(args) as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        rows = run_all(src, work, size, args)
    print(
        f"\nsource: {size / 1e9:.1f} GB Megatron TP2 PP2 (bf16, Adam state) on a machine with "
        f"{memory_bytes() / 1e9:.1f} GB of RAM; SeaweedFS on 127.0.0.1 (its data on the same "
        "disk); page cache emptied before each run; times include a final sync\n"
    )
    print(
        "| run | direction | seconds | GB/s | vs s3fs, same direction | peak RSS "
        f"| within {args.budget} + 300 MiB |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    baseline = {direction: t for name, direction, t, _ in rows if name.startswith("s3fs")}
    limit = parse_budget(args.budget) + (300 << 20)
    for name, direction, seconds, rss in rows:
        within = "-" if name.startswith("s3fs") else ("yes" if rss <= limit else "**no**")
        print(
            f"| {name} | {direction} | {seconds:.0f} | {size / seconds / 1e9:.3f} "
            f"| {baseline[direction] / seconds:.2f}x | {rss / 2**20:.0f} MiB | {within} |"
        )


def run_all(src: Path, work: Path, size: int, args: argparse.Namespace) -> list[Row]:
    """Every run, in an order that never needs three copies on the disk."""
    from tests.seaweedfs import vacuum

    s3 = f"s3://{BUCKET}"
    target = ["--tp", "1", "--pp", str(args.pp), "--memory-budget", args.budget, "--json"]
    ckptctl = [sys.executable, "-m", "ckptctl", "reshard"]
    s3fs = [sys.executable, "-c", S3FS]
    store = work / "seaweedfs"
    rows: list[Row] = []

    def time_it(name: str, direction: str, cmd: list[str], after: Callable[[], None]) -> None:
        drop_caches()
        timing = timed(cmd, prime=False)
        rows.append((name, direction, timing.seconds, timing.rss))
        print(f"{name}: {timing.seconds:.0f} s", file=sys.stderr, flush=True)
        after()

    def delete(prefix: str) -> Callable[[], None]:
        def after() -> None:
            subprocess.run([*s3fs_rm, f"{BUCKET}/{prefix}"], check=True)
            vacuum(store)

        return after

    s3fs_rm = [sys.executable, "-c", RM]
    local_out = work / "out"
    # Each output under a name of its own: SeaweedFS lists a deleted prefix for a while.
    time_it(
        "ckptctl reshard", "local->s3", [*ckptctl, str(src), f"{s3}/out1", *target], delete("out1")
    )
    time_it("s3fs put", "local->s3", [*s3fs, "put", BUCKET, "src", str(src)], lambda: None)
    remove(src)  # the store's copy is the source from here on
    keys = subprocess.run(
        [*s3fs_rm, "--list", f"{BUCKET}/src"], check=True, text=True, capture_output=True
    ).stdout.split()
    time_it(
        "s3fs copy (client-side)", "s3->s3", [*s3fs, "copy", BUCKET, "copy", *keys], delete("copy")
    )
    time_it(
        "ckptctl reshard", "s3->s3", [*ckptctl, f"{s3}/src", f"{s3}/out2", *target], delete("out2")
    )
    time_it(
        "s3fs get (+ sync)",
        "s3->local",
        [*s3fs, "get", BUCKET, "got", str(work)],
        lambda: shutil.rmtree(work / "got"),
    )
    time_it(
        "ckptctl reshard",
        "s3->local",
        [*ckptctl, f"{s3}/src", str(local_out), *target],
        lambda: shutil.rmtree(local_out),
    )
    return rows


RM = r"""
import sys
import s3fs
fs = s3fs.S3FileSystem()
if sys.argv[1] == "--list":
    print("\n".join(fs.find(sys.argv[2])))
else:
    fs.rm(sys.argv[1], recursive=True)
"""


def parse_budget(text: str) -> int:
    from ckptctl.cli.options import parse_size

    return int(parse_size(text))


if __name__ == "__main__":
    main()
