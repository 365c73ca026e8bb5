"""Megatron-LM's own load-time resharding against ``ckptctl reshard``, side by side in one run,
on a checkpoint Megatron-LM's training code wrote.

Builds once (kept in ``--workdir``): Megatron-LM 0.19.2's training code (the megatron-core
wheel's ``megatron/training``, in the tests' own environment, ``tests/megatron_lm_env.py``:
Python 3.12, built on first use) trains a GPT model (RMSNorm, SwiGLU, GQA, rotary, untied
embeddings; ``--hidden``, ``--layers``, vocabulary 32000) one step at TP2 PP2 in bf16 with the
distributed optimizer (fp32 masters and both Adam moments) and saves it as ``torch_dist`` with
``--dist-ckpt-optim-fully-reshardable`` (the optimizer form Megatron-LM can load under another
TP/PP). Then times, best of ``--repeat``, attempts round robin, each a fresh process:

* ``cp -r`` of the checkpoint (the machine's copy speed);
* Megatron-LM resharding it the way its users do: ``load_checkpoint`` under TP1 PP2 (two gloo
  ranks on the CPU, the CPU shims of ``tests/oracles/megatron_lm.py``), no training step, and
  ``save_checkpoint`` at once;
* ``ckptctl reshard --tp 1`` under ``--memory-budget``.

Then ``ckptctl verify OURS --against MEGATRON`` compares the two outputs tensor by tensor
(weights and optimizer state); the bench fails if they differ. Peak RSS: ckptctl's process;
Megatron-LM's ranks summed (each rank's own peak, from its report; the largest one beside it),
as a node must hold them all.

    python bench/bench_megatron.py [--workdir /tmp/ckptctl-bench-megatron] [--hidden 1024]
        [--layers 8] [--budget 1GiB] [--repeat 2] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from benchlib import attempt, compile_bytecode, du, memory_needed, remove

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # Megatron-LM's environment and oracle, from the tests

from tests.megatron_lm_env import command, environment  # noqa: E402

MODEL = """
    --num-attention-heads 16 --group-query-attention --num-query-groups 4
    --seq-length 16 --max-position-embeddings 32 --position-embedding-type rope
    --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --vocab-size 32000 --make-vocab-size-divisible-by 128 --tokenizer-type NullTokenizer
    --micro-batch-size 2 --global-batch-size 2 --train-iters 10 --lr 1e-4 --lr-decay-iters 10
    --attention-dropout 0 --hidden-dropout 0 --mock-data --bf16
    --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable --ckpt-format torch_dist
    --transformer-impl local --distributed-backend gloo --rerun-mode disabled
    --no-rope-fusion --no-gradient-accumulation-fusion --no-bias-swiglu-fusion
    --no-masked-softmax-fusion --no-bias-dropout-fusion --no-persist-layer-norm
"""


def model_args(hidden: int, layers: int) -> list[str]:
    ffn = hidden * 11 // 4
    size = ["--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn)]
    return [*shlex.split(MODEL), *size, "--num-layers", str(layers)]


def layout(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def generate(source: Path, work: Path, model: list[str]) -> None:
    """One training step of Megatron-LM at TP2 PP2, saved (kept for later runs)."""
    if (source / "latest_checkpointed_iteration.txt").exists():
        return
    shutil.rmtree(source, ignore_errors=True)
    save = ["--save", str(source), "--save-interval", "1000"]
    report = work / "generate.json"
    line = command(report, [*model, *layout(2, 2), *save], world=4, steps=1)
    done = subprocess.run(line, env=environment(work), capture_output=True, text=True, check=False)
    if done.returncode or not report.exists():
        sys.exit(f"Megatron-LM could not write the source:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-megatron"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--repeat", type=int, default=2, help="Runs per command (best is kept).")
    parser.add_argument("--keep", action="store_true", help="Keep the generated checkpoint.")
    args = parser.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = model_args(args.hidden, args.layers)
    source = work / f"megatron-lm-h{args.hidden}-l{args.layers}-tp2pp2"
    generate(source, work, model)
    size = du(source)
    outs = {name: work / f"out-{name}" for name in ("cp", "megatron", "ckptctl")}
    report = work / "megatron-reshard.json"
    megatron_save = ["--load", str(source), "--save", str(outs["megatron"])]
    megatron = command(
        report, [*model, *layout(1, 2), *megatron_save, "--save-interval", "1000"], world=2, steps=0
    )
    ckptctl = [sys.executable, "-m", "ckptctl", "reshard", str(source), str(outs["ckptctl"])]
    ckptctl += ["--tp", "1", "--memory-budget", args.budget, "--json"]
    runs = [
        ("cp -r", ["cp", "-r", str(source), str(outs["cp"])], outs["cp"], None),
        ("Megatron-LM 0.19.2 load_checkpoint at TP1 PP2 + save_checkpoint (2 ranks)",
         megatron, outs["megatron"], environment(work)),
        (f"ckptctl reshard --tp 1 (--memory-budget {args.budget})", ckptctl, outs["ckptctl"],
         None),
    ]  # fmt: skip
    compile_bytecode()
    best: dict[str, tuple[float, int, int]] = {}
    for round_ in range(args.repeat):
        for name, line, out, env in runs:
            report.unlink(missing_ok=True)
            timing = attempt(line, out, env=env, need=memory_needed(size))
            rss, largest = timing.rss, timing.rss
            if out == outs["megatron"]:
                peaks = json.loads(report.read_text())["peak_rss"]
                rss, largest = sum(peaks), max(peaks)
            if name not in best or timing.seconds < best[name][0]:
                best[name] = (timing.seconds, rss, largest)
            if round_ < args.repeat - 1 or out == outs["cp"]:
                remove(out)
    verdict = compare(outs["ckptctl"], outs["megatron"])
    print_rows(runs, best, size, args)
    print(f"\n{verdict}")
    for out in outs.values():
        remove(out)
    if not args.keep:
        remove(source)


def compare(ours: Path, theirs: Path) -> str:
    """ckptctl's own check of the two outputs, tensor by tensor; the bench stops if it fails."""
    line = [sys.executable, "-m", "ckptctl", "verify", str(ours), "--against", str(theirs)]
    done = subprocess.run([*line, "--json"], capture_output=True, text=True, check=False)
    try:
        checks = json.loads(done.stdout)
    except ValueError:
        sys.exit(f"verify failed: {done.stderr[-2000:]}")
    against = next((c for c in checks.get("checks", []) if c["name"] == "against"), None)
    if done.returncode or not checks.get("ok") or against is None:
        sys.exit(f"ckptctl's output differs from Megatron-LM's: {json.dumps(checks)[:3000]}")
    return f"outputs compared (`ckptctl verify --against`): {against['detail']}"


def print_rows(
    runs: list[tuple[str, list[str], Path, dict[str, str] | None]],
    best: dict[str, tuple[float, int, int]],
    size: int,
    args: argparse.Namespace,
) -> None:
    print(
        f"\nsource: {size / 1e9:.2f} GB Megatron-LM torch_dist TP2 PP2 written by its own "
        f"training code (bf16, distributed optimizer, fully reshardable; hidden {args.hidden}, "
        f"{args.layers} layers) -> TP1 PP2; times include a final sync\n"
    )
    print("| run | seconds | source GB/s | vs cp -r | peak RSS (all processes) | largest |")
    print("|---|---:|---:|---:|---:|---:|")
    cp_seconds = best[runs[0][0]][0]
    for name, *_ in runs:
        seconds, rss, largest = best[name]
        print(
            f"| {name} | {seconds:.2f} | {size / seconds / 1e9:.2f} | {cp_seconds / seconds:.2f}x "
            f"| {rss / 2**20:.0f} MiB | {largest / 2**20:.0f} MiB |"
        )
    (mlm_s, mlm_rss, _), (ours_s, ours_rss, _) = best[runs[1][0]], best[runs[2][0]]
    print(
        f"\nckptctl: {mlm_s / ours_s:.1f}x faster than Megatron-LM's load-time resharding, at "
        f"{ours_rss / mlm_rss:.2f} of its memory. Megatron-LM's ranks each count the torch "
        "pages their launcher shares with them by fork."
    )


if __name__ == "__main__":
    main()
