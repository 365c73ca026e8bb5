"""Start-up of the commands that touch no tensor bytes, against a bare ``python -c pass``.

Times (best of ``--repeat``, each a fresh process, bytecode compiled as ``pip install`` leaves
it): the interpreter alone, ``import torch`` (what every command paid before it was imported
only where tensors are cast), ``ckptctl --version``, ``formats``, ``inspect``, ``plan`` and
``consolidate --dry-run`` on the bench checkpoint of ``bench_convert.py``.

    python bench/bench_startup.py [--checkpoint /tmp/ckptctl-bench/src] [--repeat 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchlib import compile_bytecode

HERE = Path(__file__).resolve().parent


def best_of(cmd: list[str], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/ckptctl-bench/src"))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    src = args.checkpoint
    if not src.exists():
        subprocess.run(
            [sys.executable, str(HERE.parent / "examples/make_checkpoint.py"), "--out", str(src)],
            check=True,
        )
    compile_bytecode()
    ckptctl = [sys.executable, "-m", "ckptctl"]
    out = "/tmp/ckptctl-bench-startup-out"  # never written: plan and dry runs only
    runs = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("python -c 'import torch'", [sys.executable, "-c", "import torch"]),
        ("ckptctl --version", [*ckptctl, "--version"]),
        ("ckptctl formats", [*ckptctl, "formats"]),
        ("ckptctl inspect", [*ckptctl, "inspect", str(src)]),
        ("ckptctl plan (-> TP1 PP4)", [*ckptctl, "plan", str(src), out, "--tp", "1", "--pp", "4"]),
        (
            "ckptctl consolidate --dry-run",
            [*ckptctl, "consolidate", str(src), out, "--format", "hf", "--dry-run"],
        ),
    ]
    print(f"\ncheckpoint: {src}; best of {args.repeat}, each a fresh process\n")
    print("| command | seconds |")
    print("|---|---:|")
    for name, cmd in runs:
        print(f"| {name} | {best_of(cmd, args.repeat):.2f} |")


if __name__ == "__main__":
    main()
