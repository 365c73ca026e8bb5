"""``ckptctl demo``: build a small sharded checkpoint, consolidate, plan and reshard it, and check
every step with transformers or bit-for-bit."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from ckptctl.cli.inspect import describe
from ckptctl.cli.options import state
from ckptctl.cli.output import Output, boundary, human_bytes
from ckptctl.cli.running import carry_out
from ckptctl.errors import UsageError
from ckptctl.jobs import plan_consolidate, plan_reshard
from ckptctl.model.stored import Format
from ckptctl.probe import open_checkpoint

DEMO_MARKER = ".ckptctl-demo"
"""Marks a directory the demo wrote, which a later ``demo --out`` may replace."""


def demo_cmd(
    ctx: typer.Context,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Where to write (default: a temp directory).")
    ] = None,
    tp: Annotated[int, typer.Option(help="Tensor parallel size of the example.")] = 2,
    pp: Annotated[int, typer.Option(help="Pipeline parallel size of the example.")] = 2,
) -> None:
    """Make a tiny Llama as a sharded Megatron checkpoint, then consolidate and verify it."""
    out = Output()
    cli = state(ctx)
    with boundary(out, cli.debug):
        try:
            import torch
            import transformers

            from ckptctl import synth
        except ImportError as err:
            raise UsageError(
                f"the demo needs transformers ({err}); pip install 'ckptctl[examples]'"
            ) from None
        root = out_dir or Path(tempfile.mkdtemp(prefix="ckptctl-demo-"))
        if root.exists() and any(root.iterdir()):
            if not (root / DEMO_MARKER).exists():
                raise UsageError(
                    f"--out {root} is not empty and holds no earlier demo",
                    hint="choose an empty or new directory",
                )
            shutil.rmtree(root)  # an earlier demo's output, and nothing else
        root.mkdir(parents=True, exist_ok=True)
        (root / DEMO_MARKER).write_text("written by ckptctl demo; --out may replace it\n")
        out.show(f"writing everything to {root}")
        src = root / f"megatron-tp{tp}-pp{pp}"
        out.show("[bold]1.[/] building a tiny Llama (GQA, SwiGLU, vocab 1100) + one Adam step")
        model = synth.make_model(synth.tiny_llama_config(), seed=0)
        states = synth.adam_step(model, seed=0)
        synth.write_megatron(model, states, src, tp=tp, pp=pp)
        info = describe(open_checkpoint(str(src), cli.settings))
        out.show(
            f"[bold]2.[/] wrote {src}: Megatron legacy, TP{tp} PP{pp}, {len(info['files'])} "
            f"rank files, {info['tensors']} tensors (weights {human_bytes(info['weight_bytes'])}, "
            f"optimizer {human_bytes(info['optimizer_bytes'])})"
        )
        hf = root / "hf"
        job = plan_consolidate(str(src), str(hf), Format.HF, cli.settings)
        plan, report = job.plan, carry_out(out, job, quiet=True)
        out.show(
            f"[bold]3.[/] consolidate -> {hf}: plan '{plan.strategy}' ({plan.reason}); "
            f"{plan.estimates.read_requests} reads, {human_bytes(report.bytes_written)} written"
        )
        full = root / "megatron-full"
        job = plan_consolidate(str(src), str(full), Format.MEGATRON, cli.settings)
        report = carry_out(out, job, quiet=True)
        out.show(
            f"[bold]4.[/] consolidate --format megatron -> {full}: TP1 PP1 with optimizer "
            f"state, {human_bytes(report.bytes_written)} written"
        )
        transformers.logging.disable_progress_bar()
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            hf, dtype=torch.float32, attn_implementation="eager"
        )
        ids = torch.randint(0, 1100, (2, 17), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            same = torch.equal(loaded(ids).logits, model(ids).logits)
        weights = all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
        verdict = "[green]identical[/]" if same and weights else "[red]DIFFERENT[/]"
        out.show(f"[bold]5.[/] transformers loads {hf}: weights and logits {verdict}")
        target = {"tp": 1, "pp": 4, "vpp": 2}
        plan = plan_reshard(str(src), str(root / "tp1-pp4-vpp2"), target, cli.settings).plan
        others = ", ".join(
            a.strategy
            + (" (not applicable)" if a.estimates is None else f" ~{a.estimates.seconds:.3f} s")
            for a in plan.alternatives
        )
        out.show(
            f"[bold]6.[/] plan TP{tp} PP{pp} -> TP1 PP4 VPP2: {plan.strategy} "
            f"(~{plan.estimates.seconds:.3f} s by the cost model; also weighed: {others})"
        )
        moved = root / "tp1-pp4-vpp2"
        carry_out(out, plan_reshard(str(src), str(moved), target, cli.settings), quiet=True)
        back = root / f"back-tp{tp}-pp{pp}"
        back_job = plan_reshard(str(moved), str(back), {"tp": tp, "pp": pp}, cli.settings)
        carry_out(out, back_job, quiet=True)
        exact = _same_tensors(src, back)
        verdict = "[green]bit-exact[/]" if exact else "[red]DIFFERENT[/]"
        out.show(
            f"[bold]7.[/] reshard -> {moved} and back -> {back}: every tensor, optimizer "
            f"state included, {verdict}"
        )
        out.show(
            f"everything is in {root}; try: ckptctl inspect {src}   ckptctl verify {hf}   "
            f"ckptctl plan {src} --tp 1 --pp 4 --show"
        )
        if not (same and weights and exact):
            raise typer.Exit(1)


def _same_tensors(a: Path, b: Path) -> bool:
    """Every tensor of every rank file equal (RNG state is dropped by a reshard)."""
    import torch

    for path in sorted(a.rglob("*.pt")):
        x = torch.load(path, weights_only=False)
        y = torch.load(b / path.relative_to(a), weights_only=False)
        x.pop("rng_state", None)
        if not _equal(x.get("model"), y.get("model")) or not _equal(
            x.get("optimizer"), y.get("optimizer")
        ):
            return False
    return True


def _equal(x: object, y: object) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple):
        return len(x) == len(y) and all(_equal(p, q) for p, q in zip(x, y, strict=True))
    return x == y
