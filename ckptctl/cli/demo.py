"""``ckptctl demo``: build a small sharded checkpoint, consolidate, plan and reshard it, and check
every step with transformers or bit-for-bit."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from ckptctl.cli.inspect import describe
from ckptctl.cli.options import parse_size, state
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import carry_out
from ckptctl.cli.units import human_bytes
from ckptctl.errors import LayoutError, UsageError
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.pipeline.jobs import plan_consolidate, plan_reshard
from ckptctl.pipeline.probe import open_checkpoint

DEMO_MARKER = ".ckptctl-demo"
"""Marks a directory the demo wrote, which a later ``demo --out`` may replace."""


DEMO_LAYERS = 8
DEMO_QUERY_GROUPS = 8
"""Key/value heads of the demo model: TP 1, 2, 4 and 8 all divide them."""
SMALL = {"hidden": 128, "vocab": 1100}
"""The default demo: a few MiB."""


def demo_size(text: str | None) -> dict[str, int]:
    """The demo model's hidden size and vocabulary for about ``text`` bytes of checkpoint
    (fp32 weights and both Adam moments: 12 bytes a parameter); the default is tiny."""
    if text is None:
        return dict(SMALL)
    wanted = parse_size(text)
    if not 1 << 20 <= wanted <= MAX_DEMO:
        raise UsageError(
            f"--size {text}: between 1MiB and {MAX_DEMO >> 30}GiB (the demo model is built in "
            "memory; bench/ writes larger checkpoints rank file by rank file)"
        )
    vocab = 32000
    # Parameters: 2 * vocab * h (embedding, output layer) + layers * 11.25 h^2 (GQA attention
    # with half the key/value heads, SwiGLU at 2.75 h); h a multiple of 128.
    params = wanted / 12
    per_layer = 11.25 * DEMO_LAYERS
    hidden = (-2 * vocab + (4 * vocab * vocab + 4 * per_layer * params) ** 0.5) / (2 * per_layer)
    return {"hidden": max(128, round(hidden / 128) * 128), "vocab": vocab}


MAX_DEMO = 8 << 30


def demo_config(hidden: int, vocab: int) -> Any:
    from ckptctl import synth

    ffn = max(256, round(hidden * 2.75 / 64) * 64)
    return synth.tiny_llama_config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=DEMO_LAYERS,
        num_heads=2 * DEMO_QUERY_GROUPS,
        num_kv_heads=DEMO_QUERY_GROUPS,
        intermediate_size=ffn,
    )


def _check_layout(tp: int, pp: int, hidden: int) -> None:
    """The demo's layout must cut its model: checked before anything is written."""
    ffn = max(256, round(hidden * 2.75 / 64) * 64)
    spec = ModelSpec(
        num_layers=DEMO_LAYERS,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=2 * DEMO_QUERY_GROUPS,
        num_query_groups=DEMO_QUERY_GROUPS,
        kv_channels=hidden // (2 * DEMO_QUERY_GROUPS),
        vocab_size=1100,
    )
    try:
        ParallelLayout(tp=tp, pp=pp).check_against(spec)
    except LayoutError as err:
        raise UsageError(
            f"--tp {tp} --pp {pp}: {err} (the demo model has 8 layers and 8 query "
            "groups: TP 1, 2, 4 or 8 and PP 1, 2, 4 or 8)"
        ) from None


def demo_cmd(
    ctx: typer.Context,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Where to write (default: a temp directory).")
    ] = None,
    tp: Annotated[
        int, typer.Option(min=1, help="Tensor parallel size of the example (1, 2, 4 or 8).")
    ] = 2,
    pp: Annotated[
        int, typer.Option(min=1, help="Pipeline parallel size of the example (1, 2, 4 or 8).")
    ] = 2,
    size: Annotated[
        str | None,
        typer.Option(
            "--size",
            help="About how large a checkpoint to make, e.g. 2GB (default: a few MiB; at "
            "most 8GiB, the model is built in memory).",
        ),
    ] = None,
) -> None:
    """Make a small Llama as a sharded Megatron checkpoint, then consolidate, reshard and
    verify it."""
    out = Output()
    cli = state(ctx)
    with boundary(out, cli.debug):
        shape = demo_size(size)
        _check_layout(tp, pp, shape["hidden"])
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
        vocab = shape["vocab"]
        out.show(
            f"[bold]1.[/] building a Llama (hidden {shape['hidden']}, 8 layers, 16 heads in 8 "
            f"query groups, SwiGLU, vocab {vocab}) + one Adam step"
        )
        model = synth.make_model(demo_config(**shape), seed=0)
        states = synth.adam_step(model, seed=0)
        synth.write_megatron(model, states, str(src), tp=tp, pp=pp)
        info = describe(open_checkpoint(str(src), cli.settings))
        out.show(
            f"[bold]2.[/] wrote {src}: Megatron legacy, TP{tp} PP{pp}, {len(info['files'])} "
            f"rank files, {info['tensors']} tensors (weights {human_bytes(info['weight_bytes'])}, "
            f"optimizer {human_bytes(info['optimizer_bytes'])})"
        )
        hf = root / "hf"
        job = plan_consolidate(str(src), str(hf), "hf", cli.settings)
        plan, report = job.plan, carry_out(out, job, quiet=True)
        assert report is not None  # not a dry run: a report of what was written
        out.show(
            f"[bold]3.[/] consolidate -> {hf}: plan '{plan.strategy}' ({plan.reason}); "
            f"{plan.estimates.read_requests} reads, {human_bytes(report.bytes_written)} written"
        )
        full = root / "megatron-full"
        job = plan_consolidate(str(src), str(full), "megatron", cli.settings)
        report = carry_out(out, job, quiet=True)
        assert report is not None
        out.show(
            f"[bold]4.[/] consolidate --format megatron -> {full}: TP1 PP1 with optimizer "
            f"state, {human_bytes(report.bytes_written)} written"
        )
        transformers.logging.disable_progress_bar()
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            hf, dtype=torch.float32, attn_implementation="eager"
        )
        ids = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
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
        back_job = plan_reshard(str(moved), str(back), {"tp": tp, "pp": pp, "vpp": 1}, cli.settings)
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
        return (
            isinstance(y, list | tuple)
            and len(x) == len(y)
            and all(_equal(p, q) for p, q in zip(x, y, strict=True))
        )
    return x == y
