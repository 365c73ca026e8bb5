"""A/B of two ckptctl commits on the same jobs, attempts interleaved: the shared disk's slow
spells (up to 1.5x) fall on both alike, which separate bench runs cannot promise.

The older commit is checked out into a git worktree and run with ``PYTHONPATH`` pointing at
it (and ``python -P``, so the working directory cannot take its place); this checkout is the
newer side; before timing, each side is checked to import its own tree. Each attempt removes
the output, syncs, then times the job until its output is on disk (a final ``sync``). Prints
median and best per job and side, with ``cp -r`` of each source in the same rounds.

    python bench/bench_ab.py --old REV [--rounds 5] [--cold | --cold-source]
        [--reshard 4x1 [--only-reshard]]
        [--megatron /tmp/ckptctl-bench/src]
        [--deepspeed /tmp/ckptctl-bench-ds/zero2-bf16] [--dcp /tmp/ckptctl-bench-dcp/dcp]

The sources are those ``bench_convert.py --keep``, ``bench_deepspeed.py --keep`` and
``bench_dcp.py --keep`` leave (a missing one is skipped).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from benchlib import (
    CKPTCTL_IN_CHECKOUT,
    ROOT,
    Cold,
    add_cold_options,
    attempt,
    checkout_env,
    cold_of,
    compile_bytecode,
    du,
    imported_checkout,
    memory_needed,
    remove,
)

OUT = Path("/tmp/ckptctl-bench-ab-out")


def run_once(
    cmd: list[str], env: dict[str, str] | None, cold: Cold | None, prime: bool, need: int
) -> tuple[float, float | None, float]:
    """Seconds of one attempt (``benchlib.attempt``; ``need``: memory to prime) until its
    output is on disk, the part of them outside ckptctl's own 'converting' figure (start-up,
    planning, exit), and its CPU seconds."""
    seconds, _, converting, cpu = attempt(cmd, OUT, cold, env, prime, need)
    return seconds, None if converting is None else seconds - converting, cpu


def _shape(text: str) -> tuple[str, str]:
    """``4x1`` -> ("4", "1"): a reshard's target tensor- and pipeline-parallel sizes."""
    tp, _, pp = text.lower().partition("x")
    if not (tp.isdigit() and pp.isdigit() and int(tp) > 0 and int(pp) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not TPxPP, e.g. 4x1")
    return tp, pp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="The commit to compare against.")
    parser.add_argument("--rounds", type=int, default=5)
    add_cold_options(parser)
    parser.add_argument("--megatron", type=Path, default=Path("/tmp/ckptctl-bench/src"))
    parser.add_argument("--deepspeed", type=Path, default=Path("/tmp/ckptctl-bench-ds/zero2-bf16"))
    parser.add_argument("--dcp", type=Path, default=Path("/tmp/ckptctl-bench-dcp/dcp"))
    parser.add_argument(
        "--reshard",
        action="append",
        default=[],
        metavar="TPxPP",
        type=_shape,
        help="Also reshard the megatron source to this TP x PP (e.g. 4x1); repeatable.",
    )
    parser.add_argument(
        "--only-reshard", action="store_true", help="Skip the consolidations (with --reshard)."
    )
    parser.add_argument(
        "--unprimed",
        action="store_true",
        help="Do not prime memory before each attempt (see benchlib.prime_memory).",
    )
    args = parser.parse_args()
    # The worktree is named by the commit, not by how it was spelled: a second run with
    # ``--old HEAD`` after a commit must not reuse the tree the first one checked out.
    resolve = ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{args.old}^{{commit}}"]
    commit = subprocess.run(resolve, check=True, capture_output=True, text=True).stdout.strip()
    old = Path(f"/tmp/ckptctl-ab-{commit[:12]}")
    if not old.exists():
        worktree = ["git", "-C", str(ROOT), "worktree", "add", "-f", str(old), commit]
        subprocess.run(worktree, check=True)
    compile_bytecode()
    compile_bytecode(old)
    ckptctl = CKPTCTL_IN_CHECKOUT
    jobs: list[tuple[str, list[str], bool, Path]] = []  # (row, command, is ckptctl, source)
    # (what cp -r copies, the source ckptctl reads, its --format): one pair of rows each
    sources = [
        ("megatron source", args.megatron, args.megatron, "megatron"),
        ("DCP source", args.dcp, args.dcp, "torch"),
    ]
    if args.deepspeed.exists():
        tag = args.deepspeed / (args.deepspeed / "latest").read_text().strip()
        sources.insert(1, ("ZeRO-2 tag", tag, args.deepspeed, "deepspeed-universal"))
    for label, copied, src, fmt in [] if args.only_reshard else sources:
        if src.exists():
            job = [*ckptctl, "consolidate", str(src), str(OUT), "--format", fmt, "--json"]
            jobs += [
                (f"cp -r ({label})", ["cp", "-r", str(copied), str(OUT)], False, copied),
                (f"consolidate --format {fmt} ({label})", job, True, copied),
            ]
    if args.reshard and args.megatron.exists():
        if args.only_reshard:  # else the consolidations' rows hold its cp -r already
            copy = ["cp", "-r", str(args.megatron), str(OUT)]
            jobs.append(("cp -r (megatron source)", copy, False, args.megatron))
        for tp, pp in args.reshard:
            reshard = [*ckptctl, "reshard", str(args.megatron), str(OUT), "--tp", tp, "--pp", pp]
            reshard += ["--memory-budget", "512MiB", "--json"]
            jobs.append((f"reshard -> TP{tp} PP{pp}", reshard, True, args.megatron))
    if not jobs:
        sys.exit(
            "no source found: run bench_convert.py, bench_deepspeed.py or bench_dcp.py with --keep"
        )
    sides = {"old": checkout_env(old), "new": checkout_env(ROOT)}
    for (side, env), tree in zip(sides.items(), (old, ROOT), strict=True):
        imported = imported_checkout(env)
        if imported != tree.resolve():
            sys.exit(f"the {side} side imports ckptctl from {imported}, not {tree}")
    times: dict[tuple[str, str], list[tuple[float, float | None, float]]] = {}
    needs = {source: memory_needed(du(source)) for _, _, _, source in jobs}
    for round_ in range(args.rounds):
        order = list(sides.items()) if round_ % 2 == 0 else list(sides.items())[::-1]
        for name, cmd, is_ckptctl, source in jobs:  # each side goes first every other round
            cold = cold_of(args, source)
            for side, env in order if is_ckptctl else [("-", None)]:
                run = run_once(cmd, env, cold, not args.unprimed, needs[source])
                times.setdefault((name, side), []).append(run)
    remove(OUT)
    print(
        f"\nold = {args.old} ({commit[:12]}), new = this checkout; {args.rounds} rounds, "
        "interleaved, the side going first alternating"
        + (f"; {cold.describe()}" if (cold := cold_of(args, jobs[0][3])) else "")
        + ("; memory not primed\n" if args.unprimed else "; memory primed before every attempt\n")
    )
    print(
        "| job | side | median s | best s | median s outside converting | median CPU s "
        "| every attempt |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for (name, side), seen in times.items():
        walls = [wall for wall, _, _ in seen]
        outside = [o for _, o, _ in seen if o is not None]
        cpu = statistics.median(c for _, _, c in seen)
        beside = f"{statistics.median(outside):.3f}" if outside else "-"
        every = " ".join(f"{t:.2f}" for t in walls)
        print(
            f"| {name} | {side} | {statistics.median(walls):.2f} | {min(walls):.2f} | {beside} "
            f"| {cpu:.2f} | {every} |"
        )


if __name__ == "__main__":
    main()
