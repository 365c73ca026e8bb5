"""Throughput of ckptctl on S3 against a plain s3fs copy of the same bytes, in one run.

Starts moto's S3 server on 127.0.0.1 (the same local endpoint the tests use), uploads a
generated Megatron checkpoint with Adam state (TP2 PP2), then times:

* plain s3fs copy s3 -> s3 (every object read and written by the client, 8 MiB blocks: the
  data path a reshard must take) and s3 -> local (``fs.get``),
* ``ckptctl reshard`` s3 -> s3 (TP2 PP2 -> TP1 PP4), ``ckptctl consolidate --format megatron``
  s3 -> local, and ``ckptctl reshard`` local -> s3 with ``--stage-dir``.

Every ckptctl run is a fresh process (its start-up counted). Prints a markdown table with
seconds, GB/s and the ratio to the plain copy in the same direction.

    python bench/bench_s3.py [--workdir /tmp/ckptctl-bench-s3] [--hidden 1024] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import du

HERE = Path(__file__).resolve().parent


def best_of(repeat: int, run, cleanup) -> float:
    times = []
    for _ in range(repeat):
        cleanup()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-s3"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("bench")
    work = args.workdir
    src = work / "src"
    if not src.exists():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                str(HERE.parent / "examples/make_checkpoint.py"),
                *("--out", str(src), "--tp", "2", "--pp", "2"),
                *("--hidden", str(args.hidden), "--heads", "16", "--kv-heads", "4"),
                *("--ffn", str(args.hidden)),
            ],
            check=True,
        )
    size = du(src)
    fs.put(str(src), "bench/src", recursive=True)
    objects = [p for p in fs.find("bench/src")]

    def rm(path: str):
        def clean() -> None:
            if path.startswith("bench/"):
                if fs.exists(path):
                    fs.rm(path, recursive=True)
            else:
                shutil.rmtree(path, ignore_errors=True)
            fs.invalidate_cache()

        return clean

    def s3fs_copy() -> None:
        for key in objects:
            with (
                fs.open(key, "rb", block_size=8 << 20) as r,
                fs.open(key.replace("bench/src", "bench/copy"), "wb", block_size=8 << 20) as w,
            ):
                while block := r.read(8 << 20):
                    w.write(block)

    def ckptctl(*argv: str):
        def run() -> None:
            done = subprocess.run(
                [sys.executable, "-m", "ckptctl", *argv, "--json"], capture_output=True, text=True
            )
            if done.returncode:
                sys.exit(f"failed: ckptctl {' '.join(argv)}\n{done.stderr[-2000:]}")

        return run

    local_out = str(work / "out")
    rows = [
        ("s3fs copy s3 -> s3 (client-side)", "s3->s3", s3fs_copy, rm("bench/copy")),
        (
            "s3fs get s3 -> local",
            "s3->local",
            lambda: fs.get("bench/src", local_out, recursive=True),
            rm(local_out),
        ),
        (
            "ckptctl reshard s3 -> s3 (TP1 PP4)",
            "s3->s3",
            ckptctl("reshard", "s3://bench/src", "s3://bench/rs", "--tp", "1", "--pp", "4"),
            rm("bench/rs"),
        ),
        (
            "ckptctl consolidate --format megatron s3 -> local",
            "s3->local",
            ckptctl("consolidate", "s3://bench/src", local_out, "--format", "megatron"),
            rm(local_out),
        ),
        (
            "ckptctl reshard local -> s3 --stage-dir",
            "local->s3",
            ckptctl(
                "reshard",
                str(src),
                "s3://bench/staged",
                *("--tp", "1", "--pp", "4", "--stage-dir", str(work / "stage")),
            ),
            rm("bench/staged"),
        ),
        (
            "s3fs put local -> s3",
            "local->s3",
            lambda: fs.put(str(src), "bench/put", recursive=True),
            rm("bench/put"),
        ),
    ]
    results = {name: best_of(args.repeat, run, clean) for name, _, run, clean in rows}
    baseline = {
        "s3->s3": results[rows[0][0]],
        "s3->local": results[rows[1][0]],
        "local->s3": results[rows[5][0]],
    }
    print(f"\ncheckpoint: {size / 1e9:.2f} GB in {len(objects)} objects; moto at {host}:{port}\n")
    print("| run | direction | seconds | GB/s | ratio to s3fs, same direction |")
    print("|---|---|---|---|---|")
    for name, direction, _, _ in rows:
        t = results[name]
        print(
            f"| {name} | {direction} | {t:.2f} | {size / t / 1e9:.3f} | "
            f"{baseline[direction] / t:.2f}x |"
        )
    # What a ranged GET costs on this server, by object size: moto answers a range by copying
    # the whole object, so range-heavy jobs pay for object size, which S3 itself does not.
    fs.pipe("bench/small", os.urandom(8 << 20))
    largest = max(objects, key=fs.size)
    for key in ("bench/small", largest):
        start = time.perf_counter()
        for i in range(5):
            fs.cat_file(key, start=i << 20, end=(i + 1) << 20)
        ms = (time.perf_counter() - start) / 5 * 1e3
        print(
            f"\n1 MiB ranged GET from a {fs.size(key) / 2**20:.0f} MiB object: {ms:.1f} ms", end=""
        )
    print()
    server.stop()


if __name__ == "__main__":
    main()
