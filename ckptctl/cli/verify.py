"""``ckptctl verify``: is a checkpoint whole and sound, and (``--against``) equal to another."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from ckptctl.cli.options import CheckWorkers, Json, state
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import launch_workers
from ckptctl.errors import UsageError
from ckptctl.pipeline.distributed import from_environment


def verify_cmd(
    ctx: typer.Context,
    ckpt: Annotated[str, typer.Argument(help="Checkpoint directory or URL.")],
    numerics: Annotated[bool, typer.Option("--numerics", help="Scan for NaN/Inf.")] = False,
    other: Annotated[
        str | None,
        typer.Option("--against", help="Compare every tensor with this checkpoint."),
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--only",
            help="With --against: compare only tensors whose canonical name matches this glob "
            "pattern (repeatable), e.g. 'decoder.layers.0.*'.",
        ),
    ] = None,
    weights_only: Annotated[
        bool,
        typer.Option(
            "--weights-only",
            help="With --against: compare the weights alone (one side holds no optimizer state).",
        ),
    ] = False,
    rtol: Annotated[float, typer.Option("--rtol", help="Relative tolerance.")] = 0.0,
    atol: Annotated[float, typer.Option("--atol", help="Absolute tolerance.")] = 0.0,
    as_json: Json = False,
    workers: CheckWorkers = 1,
) -> None:
    """Check a checkpoint is whole: completion marker, manifest sizes and checksums, the
    checksums its files carry (zip CRC-32), structure, coverage of every tensor, (--numerics)
    finite values, and (--against B) equal to B tensor by tensor in any layout or format.
    Exit 0 all passed, 1 a check failed, 2 usage, 3 bad input, 4 storage error."""
    from ckptctl.verify.checks import against, verify
    from ckptctl.verify.checks import as_json as report_json

    out = Output(as_json)
    cli = state(ctx)
    with boundary(out, cli.debug):
        launch_workers(workers)
        if cli.settings.text_only and other is None:
            raise UsageError(
                "--text-only reads the --against checkpoint's text decoder (a vision-language "
                "release's, to compare a text model converted from it); give --against too"
            )
        # --text-only reads the reference's decoder: the checkpoint checked is read as it is
        settings = dataclasses.replace(cli.settings, text_only=False)
        group = from_environment()
        if group is not None:
            out.silent = group.rank != 0
        try:
            checks = verify(
                ckpt,
                settings,
                numerics=numerics,
                group=group,
                progress=out.progress(),
                against=other is not None,
            )
        finally:
            if group is not None:
                group.close()
        if other is None and (only or weights_only):
            raise UsageError("--only and --weights-only narrow --against; give --against too")
        tensors: list[dict] = []
        counts: dict = {}
        if other is not None and (group is None or group.rank == 0):  # rank 0 compares
            check, tensors, counts = against(
                ckpt,
                other,
                cli.settings,
                rtol=rtol,
                atol=atol,
                only=tuple(only or ()),
                weights_only=weights_only,
                progress=out.progress(),
            )
            checks.append(check)
        report = report_json(checks)
        if other is not None and (group is None or group.rank == 0):
            report["against"] = counts
            report["tensors"] = tensors
        if as_json:
            out.json(report)
        else:
            colour = {"passed": "green", "failed": "red", "skipped": "yellow"}
            for c in checks:
                out.show(f"[{colour[c.status]}]{c.status:>7}[/] {c.name}: {c.detail}")
            _show_quantized(out, tensors)
        if not report["ok"]:
            raise typer.Exit(1)


def _show_quantized(out: Output, tensors: list[dict]) -> None:
    """Each quantized tensor's error against the other checkpoint (compress --quantize)."""
    rows = [t for t in tensors if "quantized_max_abs_error" in t]
    if not rows:
        return
    table = out.table(title="quantized tensors (lossy)", title_justify="left")
    for column in ("tensor", "max abs diff", "recorded at compression"):
        table.add_column(column, justify="left" if column == "tensor" else "right")
    for t in rows:
        table.add_row(t["name"], f"{t['max_abs_diff']:.3g}", f"{t['quantized_max_abs_error']:.3g}")
    out.show(table)
