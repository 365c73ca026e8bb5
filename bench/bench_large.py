"""A Megatron checkpoint larger than this machine's memory, moved with the page cache emptied.

Generates (once, kept in ``--workdir``) a Megatron-LM legacy TP2 PP2 checkpoint with bf16
weights and Adam state (fp32 masters, both moments) of more bytes than the machine has RAM,
rank file by rank file (``ckptctl.synth.large``: no process ever holds it whole). Then, in one
run, each attempt after ``sync`` and emptying the page cache (root): ``cp -r`` of the same
files, ``ckptctl reshard`` to TP1 PP5 (``--pp``) under ``--memory-budget``, and ``ckptctl
consolidate --format hf`` (reads the weights only). Prints a markdown table: seconds (final sync
included), source GB/s, ratio to ``cp -r``, peak RSS; ``--json OUT`` also writes the figures.

    sudo python bench/bench_large.py [--workdir /tmp/ckptctl-large] [--budget 1GiB]
        [--repeat 1] [--layers 10] [--only cp,reshard,hf] [--json OUT]

Needs about 2.1x the checkpoint's size free on the work folder's file system (the source and
one output at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from benchlib import check_free_space, drop_caches, du, remove, timed

HERE = Path(__file__).resolve().parent

GENERATE = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from ckptctl import synth
from ckptctl.synth.large import MadeStates, MadeWeights, parameter_count
from ckptctl.synth.megatron import write_megatron_canonical
out, layers, hidden, ffn, heads, kv = sys.argv[1], *map(int, sys.argv[3:8])
config = synth.tiny_llama_config(vocab_size=32000, hidden_size=hidden, num_layers=layers,
    num_heads=heads, num_kv_heads=kv, intermediate_size=ffn)
write_megatron_canonical(config, MadeWeights(config), MadeStates(config), out, tp=2, pp=2,
    params_dtype=torch.bfloat16)
print(parameter_count(config))
"""


def generate(src: Path, args: argparse.Namespace) -> None:
    partial = src.with_name(src.name + ".partial")
    remove(partial)
    sizes = [args.layers, args.hidden, args.ffn, args.heads, args.kv_heads]
    subprocess.run(
        [sys.executable, "-c", GENERATE, str(partial), str(HERE.parent), *map(str, sizes)],
        check=True,
    )
    partial.rename(src)


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-large"))
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--repeat", type=int, default=1, help="Attempts per run (best kept).")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--pp", type=int, default=5, help="The reshard's target PP (TP1).")
    parser.add_argument("--only", default="cp,reshard,hf", help="Runs to time, comma-separated.")
    parser.add_argument("--extra", default="", help="More ckptctl options for both jobs.")
    parser.add_argument("--json", type=Path, help="Also write the figures here.")
    parser.add_argument(
        "--allow-smaller", action="store_true", help="Time a checkpoint that fits in memory."
    )
    args = parser.parse_args()
    work = args.workdir
    src = work / f"src-l{args.layers}-h{args.hidden}"
    if not src.exists():
        work.mkdir(parents=True, exist_ok=True)
        generate(src, args)
    size = du(src)
    if size <= memory_bytes() and not args.allow_smaller:
        sys.exit(
            f"{src}: {size / 1e9:.1f} GB fits in this machine's {memory_bytes() / 1e9:.1f} GB "
            "of memory; raise --layers (or pass --allow-smaller)"
        )
    ckptctl = [sys.executable, "-m", "ckptctl"]
    extra = args.extra.split()
    jobs = {
        "cp": ("cp -r", ["cp", "-r", str(src), str(work / "copy")], work / "copy"),
        "reshard": (
            f"ckptctl reshard -> TP1 PP{args.pp} (--memory-budget {args.budget})",
            [
                *ckptctl,
                "reshard",
                str(src),
                str(work / "tp1"),
                "--tp",
                "1",
                "--pp",
                str(args.pp),
                "--memory-budget",
                args.budget,
                "--json",
                *extra,
            ],
            work / "tp1",
        ),
        "hf": (
            f"ckptctl consolidate --format hf (--memory-budget {args.budget})",
            [
                *ckptctl,
                "consolidate",
                str(src),
                str(work / "hf"),
                "--format",
                "hf",
                "--memory-budget",
                args.budget,
                "--json",
                *extra,
            ],
            work / "hf",
        ),
    }
    chosen = [jobs[name] for name in args.only.split(",")]
    best: dict[str, tuple[float, int, int]] = {}
    for _ in range(args.repeat):
        for name, cmd, out in chosen:
            remove(out)
            check_free_space(out, size)
            drop_caches()
            timing = timed(cmd, env={**os.environ, "PYTHONPATH": str(HERE.parent)}, prime=False)
            written = du(out)
            remove(out)
            if name not in best or timing.seconds < best[name][0]:
                best[name] = (timing.seconds, timing.rss, written)
            print(f"{name}: {timing.seconds:.1f} s, peak RSS {timing.rss / 2**20:.0f} MiB")
    cp = best.get("cp -r", (0.0, 0, 0))[0]
    print(
        f"\nsource: {size / 1e9:.1f} GB Megatron TP2 PP2 (bf16, Adam state) on a machine with "
        f"{memory_bytes() / 1e9:.1f} GB of RAM; page cache emptied before each attempt; "
        "times include a final sync\n"
    )
    print("| run | seconds | GB written | source GB/s | vs cp -r | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name, (seconds, rss, written) in best.items():
        ratio = cp / seconds if cp else float("nan")
        print(
            f"| {name} | {seconds:.1f} | {written / 1e9:.1f} | {size / seconds / 1e9:.2f} | "
            f"{ratio:.2f}x | {rss / 2**20:.0f} MiB |"
        )
        rows.append({"run": name, "seconds": seconds, "bytes_written": written, "rss": rss})
    if args.json:
        machine = {"cpus": os.cpu_count(), "memory": memory_bytes(), "system": platform.platform()}
        document = {"source_bytes": size, "machine": machine, "runs": rows}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if shutil.disk_usage(work).free < size:
        print(f"(the source stays in {src} for the next run)")


if __name__ == "__main__":
    main()
