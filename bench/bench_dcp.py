"""Throughput and peak memory of ``ckptctl consolidate --format torch`` on a PyTorch DCP checkpoint,
against this machine's `cp` and torch's own ``dcp_to_torch_save``.

Generates a generic DCP checkpoint with torch itself (``dcp.save(..., no_dist=True)`` of a
nested ``{"model": {...}, "optim": {"state": {...}, "param_groups": [...]}}``: a few dozen fp32
weights plus Adam-shaped ``exp_avg`` / ``exp_avg_sq`` / ``step`` for each, ~1.7 GB by default),
then, in one run, times: ``cp -r`` of the same bytes (the machine's copy speed), torch's
``format_utils.dcp_to_torch_save`` in a subprocess (loads the whole state dict into RAM, then
``torch.save``), and ``python -m ckptctl consolidate DIR OUT --format torch --json``. Prints a
markdown table: seconds, GB/s, ratio to `cp`, peak RSS. ``--check`` also compares the two
consolidated files tensor by tensor, bit for bit.

    python bench/bench_dcp.py [--workdir /tmp/ckptctl-bench-dcp] [--hidden 1024] [--layers 6]
        [--vocab 32000] [--repeat 3] [--check] [--keep] [--generate-only]
        [--cold | --cold-source]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchlib import add_cold_options, cache_for, du, measure, print_table, remove

# Runs in its own process so the bench driver never holds the state dict (and its RSS is not
# anyone's measurement). Deterministic in the seed; every tensor a fresh contiguous fp32 tensor.
GENERATE = r"""
import sys, torch
import torch.distributed.checkpoint as dcp
out, hidden, layers, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
gen = torch.Generator().manual_seed(0)
def rand(*shape):
    return torch.randn(*shape, generator=gen)
model = {"embed.weight": rand(vocab, hidden)}
for i in range(layers):
    p = f"layers.{i}."
    model[p + "attn_norm.weight"] = 1 + 0.1 * rand(hidden)
    model[p + "attn.qkv.weight"] = rand(3 * hidden, hidden)
    model[p + "attn.proj.weight"] = rand(hidden, hidden)
    model[p + "mlp_norm.weight"] = 1 + 0.1 * rand(hidden)
    model[p + "mlp.fc1.weight"] = rand(4 * hidden, hidden)
    model[p + "mlp.fc2.weight"] = rand(hidden, 4 * hidden)
model["norm.weight"] = 1 + 0.1 * rand(hidden)
model["output.weight"] = rand(vocab, hidden)
state = {
    name: {"step": torch.tensor(100.0), "exp_avg": 1e-3 * rand(*w.shape),
           "exp_avg_sq": 1e-6 * rand(*w.shape).abs()}
    for name, w in model.items()
}
groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
           "params": list(model)}]
dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}},
         checkpoint_id=out, no_dist=True)
"""

CKPTCTL = [sys.executable, "-m", "ckptctl"]

TORCH_CONSOLIDATE = r"""
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""

# Loads both files whole: run only with --check, after the timings.
CHECK = r"""
import sys, torch
def walk(a, b, where):
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(b, dict):
        assert isinstance(a, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for k in b:
            walk(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"
walk(torch.load(sys.argv[1], weights_only=False, mmap=True),
     torch.load(sys.argv[2], weights_only=False, mmap=True), "state_dict")
print("identical")
"""


def generate(src: Path, hidden: int, layers: int, vocab: int) -> None:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", GENERATE, str(src), str(hidden), str(layers), str(vocab)],
        check=True,
    )
    files = sorted(p.name for p in src.iterdir())
    print(
        f"generated {src}: {du(src) / 1e9:.2f} GB in {len(files)} files ({', '.join(files)}) "
        f"in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-dcp"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=3, help="Runs per command (best is kept).")
    parser.add_argument("--check", action="store_true", help="Compare the two outputs bitwise.")
    parser.add_argument("--keep", action="store_true", help="Keep the generated checkpoint.")
    parser.add_argument(
        "--generate-only", action="store_true", help="Write the DCP checkpoint and stop."
    )
    add_cold_options(parser)
    args = parser.parse_args()
    work = args.workdir
    src = work / "dcp"
    if not (src / ".metadata").exists():
        remove(src)
        work.mkdir(parents=True, exist_ok=True)
        generate(src, args.hidden, args.layers, args.vocab)
    if args.generate_only:
        return
    size = du(src)
    runs = [
        ("cp -r (machine copy speed)", ["cp", "-r", str(src), str(work / "copy")], work / "copy"),
        (
            "torch dcp_to_torch_save",
            [sys.executable, "-c", TORCH_CONSOLIDATE, str(src), str(work / "torch.pt")],
            work / "torch.pt",
        ),
        (
            "ckptctl consolidate --format torch",
            [
                *CKPTCTL,
                "consolidate",
                str(src),
                str(work / "ckptctl"),
                "--format",
                "torch",
                "--json",
            ],
            work / "ckptctl",
        ),
    ]
    cold, cache = cache_for(args, src)
    # Outputs are kept for --check only.
    keep = {out for _, _, out in runs[1:]} if args.check else set()
    rows = measure(runs, size, args.repeat, keep, cold=cold)

    print_table(
        rows,
        f"{size / 1e9:.2f} GB PyTorch DCP (dcp.save, no_dist) of fp32 model + Adam state; " + cache,
        "'seconds': the whole process until its output is on disk (Python and torch start-up "
        "and a final sync included); 'of which converting': ckptctl's own --json figure.",
    )
    if args.check:
        ours, theirs = work / "ckptctl" / "state_dict.pt", work / "torch.pt"
        result = subprocess.run(
            [sys.executable, "-c", CHECK, str(ours), str(theirs)], capture_output=True, text=True
        )
        verdict = result.stdout.strip() or result.stderr.strip().splitlines()[-1]
        print(f"\n--check: ckptctl's state_dict.pt vs torch's: {verdict}")
        remove(work / "ckptctl")
        remove(theirs)
    if not args.keep:
        remove(src)


if __name__ == "__main__":
    main()
