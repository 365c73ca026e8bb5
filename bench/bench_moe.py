"""Throughput of resharding a mixture-of-experts checkpoint (EP2 -> EP4) against a dense one of
the same size (TP2 -> TP4), each as a ratio to this machine's `cp -r` of the same bytes.

Builds, once, a transformers Mixtral (8 experts) and a Llama whose one MLP holds as many
parameters as the eight experts together (same bytes, same layer count), cuts each into a
Megatron checkpoint with ckptctl (Mixtral at EP2 TP1 DP2, Llama at TP2), then in one run times
`cp -r` of each source and the two reshards under ``--memory-budget``. Prints a markdown table:
seconds, GB/s, ratio to `cp` of the same source, peak RSS; and the ratio of GB written per
second to cp's (an MoE target holds more bytes than its source).

    python bench/bench_moe.py [--workdir /tmp/ckptctl-bench-moe] [--hidden 1024] [--layers 4]
        [--budget 512MiB] [--repeat 3] [--keep] [--adam]

``--adam`` gives both sources per-parameter Adam state (moments of the right shapes in
megatron-core's layout, numbered by ckptctl's layout module: an input for timing, not a test).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from benchlib import du, measure, print_table

EXPERTS = 8

MAKE = r"""
import sys, torch, transformers
kind, out = sys.argv[1], sys.argv[2]
hidden, layers, experts = (int(x) for x in sys.argv[3:6])
common = dict(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers,
              num_attention_heads=16, num_key_value_heads=4)
expert_ffn = 3 * hidden
if kind == "moe":
    config = transformers.MixtralConfig(**common, intermediate_size=expert_ffn,
                                        num_local_experts=experts, num_experts_per_tok=2)
    cls = transformers.MixtralForCausalLM
else:  # the eight experts' parameters in one MLP
    config = transformers.LlamaConfig(**common, intermediate_size=experts * expert_ffn)
    cls = transformers.LlamaForCausalLM
with torch.device("meta"):
    model = cls(config)
model = model.to_empty(device="cpu")
generator = torch.Generator().manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02, generator=generator)
model.save_pretrained(out)
"""


ADAM = r"""
import sys, glob, torch
from ckptctl.pipeline.probe import open_checkpoint
from ckptctl.formats.megatron_common.layout import (
    optimizer_index, param_groups, rank_params, sub_optimizers,
)
# Benchmark input only: Adam moments of the right shapes in megatron-core's per-parameter
# (FP32Optimizer, chained under EP > 1) layout, numbered the way ckptctl's layout module says.
root = sys.argv[1]
ckpt = open_checkpoint(root)
spec, layout, style = ckpt.view.spec, ckpt.view.layout, ckpt.style
generator = torch.Generator().manual_seed(0)
for file in ckpt.view.files:
    state = torch.load(f"{root}/{file.path}", weights_only=False)
    params = rank_params(spec, layout, file.rank[1], style.naming, style.layer_order,
                         file.ep_rank, style.expert_naming)
    model = state["model"]
    optimizers = []
    for members in sub_optimizers(params, layout.ep > 1):
        groups = param_groups(params, members=members)
        torch_state = {}
        for pos, (index, _, _) in optimizer_index(groups).items():
            weight = model[params[pos].local_name]
            torch_state[index] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.randn(weight.shape, generator=generator),
                "exp_avg_sq": torch.rand(weight.shape, generator=generator),
            }
        optimizers.append({
            "state": torch_state,
            "param_groups": [
                {"wd_mult": 0.0 if kind else 1.0, "lr_mult": 1.0, "lr": 1e-4,
                 "weight_decay": 0.0 if kind else 0.1, "params": sorted(
                     optimizer_index(groups)[p][0] for p in ps)}
                for kind, ps in groups
            ],
        })
    state["optimizer"] = optimizers if layout.ep > 1 else optimizers[0]
    torch.save(state, f"{root}/{file.path}")
import os
os.remove(f"{root}/ckptctl.manifest.json")  # the files changed: now a plain Megatron checkpoint
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-moe"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--budget", default="512MiB")
    parser.add_argument("--keep", action="store_true", help="Keep the generated checkpoints.")
    parser.add_argument("--repeat", type=int, default=3, help="Runs per command (best is kept).")
    parser.add_argument(
        "--adam", action="store_true", help="Give both sources per-parameter Adam state."
    )
    args = parser.parse_args()
    work = args.workdir
    ckptctl = [sys.executable, "-m", "ckptctl"]
    sources = {"moe": ["--ep", "2", "--dp", "2"], "dense": ["--tp", "2"]}
    made_with = json.dumps({"hidden": args.hidden, "layers": args.layers, "adam": args.adam})
    for kind, layout in sources.items():
        stamp = work / f"{kind}.made-with.json"
        if (work / kind).exists() and stamp.exists() and stamp.read_text() == made_with:
            continue  # kept from an earlier run with the same options
        for stale in (work / kind, work / f"{kind}-hf"):
            shutil.rmtree(stale, ignore_errors=True)
        hf = work / f"{kind}-hf"
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-c",
                MAKE,
                kind,
                str(hf),
                *map(str, (args.hidden, args.layers, EXPERTS)),
            ],
            check=True,
        )
        subprocess.run([*ckptctl, "reshard", str(hf), str(work / kind), *layout], check=True)
        shutil.rmtree(hf)
        if args.adam:
            subprocess.run([sys.executable, "-c", ADAM, str(work / kind)], check=True)
        stamp.write_text(made_with)
    tables = []
    for kind, target, name in (
        ("moe", ["--ep", "4", "--dp", "4"], "EP2 -> EP4"),
        ("dense", ["--tp", "4"], "TP2 -> TP4"),
    ):
        src = work / kind
        out = work / f"{kind}-out"
        copy = work / "copy"
        runs = [
            ("cp -r (machine copy speed)", ["cp", "-r", str(src), str(copy)], copy),
            (
                f"ckptctl reshard {name} (--memory-budget {args.budget})",
                [*ckptctl, "reshard", str(src), str(out), *target, "--memory-budget",
                 args.budget, "--json"],
                out,
            ),
        ]  # fmt: skip
        subprocess.run(["cat", *map(str, src.rglob("*.pt"))], stdout=subprocess.DEVNULL, check=True)
        tables.append((kind, du(src), measure(runs, du(src), args.repeat)))
    for kind, size, rows in tables:
        what = f"Mixtral, {EXPERTS} experts, EP2 TP1" if kind == "moe" else "Llama, TP2"
        held = "weights and Adam state" if args.adam else "weights"
        source = f"{size / 1e9:.2f} GB Megatron {what} ({held}); page cache warm"
        print_table(rows, source, per_byte_written(rows))

    if not args.keep:
        shutil.rmtree(work)


def per_byte_written(rows: list) -> str:
    """An MoE target holds more bytes than its source (each EP rank file carries the dense part
    and its optimizer state): compare GB written per second with cp's as well."""
    (_, cp_seconds, _, cp_written, *_), (_, seconds, _, written, *_) = rows
    rate, cp_rate = written / seconds, cp_written / cp_seconds
    return (
        f"per byte written: ckptctl {rate / 1e9:.2f} GB/s, cp {cp_rate / 1e9:.2f} GB/s: "
        f"{rate / cp_rate:.2f}x"
    )


if __name__ == "__main__":
    main()
