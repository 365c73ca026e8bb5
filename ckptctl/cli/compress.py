"""``ckptctl compress`` / ``decompress``: a checkpoint stored losslessly in fewer bytes, as a
delta against an earlier checkpoint of the same run if given; every command reads it as is."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ckptctl.cli.options import DryRun, Json, state
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.units import human_bytes


def _show(out: Output, verb: str, r: Any) -> None:
    """One line: files, bytes before and after, ratio, time (``r``: a ``CompressReport``)."""
    rate = r.bytes_in / r.seconds if r.seconds else 0.0
    out.show(
        f"{verb} {r.files} files: {human_bytes(r.bytes_in)} -> {human_bytes(r.bytes_out)} "
        f"(ratio {max(r.bytes_in, r.bytes_out) / max(min(r.bytes_in, r.bytes_out), 1):.2f}) "
        f"in {r.seconds:.2f} s, "
        f"{human_bytes(rate)}/s in"
    )


def _opener(url: str, config: Any) -> Any:
    """The source opened as the pipeline opens it (compression finds tensors through it)."""
    from ckptctl.pipeline.probe import open_checkpoint
    from ckptctl.settings import Settings

    return open_checkpoint(url, Settings(storage=config))


def _show_plan(
    out: Output,
    source: str,
    target: str,
    base: str | None,
    storage: Any,
    as_json: bool,
    quantize: str | None,
) -> None:
    from ckptctl.compression.plan import plan_compress
    from ckptctl.io.calibrate import saved_profiles

    plan = plan_compress(source, target, base, storage, saved_profiles(), quantize, _opener)
    if as_json:
        out.json(plan.as_dict())
        return
    delta = f", {plan.delta_files} as deltas against {base}" if base else ""
    if quantize:
        delta += f", {human_bytes(plan.quantized_bytes)} of tensors quantized (LOSSY)"
    out.show(
        f"compress {plan.files} files ({human_bytes(plan.bytes_in)}{delta}) -> {target}\n"
        f"ratio {plan.ratio:.2f} measured on {human_bytes(plan.sampled_bytes)} of sampled "
        f"chunks: about {human_bytes(plan.estimated_bytes_out)} stored, "
        f"~{plan.estimated_seconds:.1f} s (cost model)\nnothing written (--dry-run)"
    )


def compress_cmd(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="Checkpoint directory or URL (any format).")],
    target: Annotated[str, typer.Argument(help="New directory or URL for the compressed copy.")],
    base: Annotated[
        str | None,
        typer.Option(
            "--base",
            help="An earlier checkpoint of the same run: files are stored as deltas against "
            "the same files of it (it must stay in place, unchanged, to read this one).",
        ),
    ] = None,
    quantize: Annotated[
        str | None,
        typer.Option(
            "--quantize",
            help="LOSSY, opt-in: store float tensors as int8 per block of 256 (a quarter of "
            "fp32's bytes): 'weights' (model weights only) or 'all' (optimizer state and fp32 "
            "masters too). Recorded as lossy; verify --against reports each tensor's error.",
        ),
    ] = None,
    dry_run: DryRun = False,
    as_json: Json = False,
) -> None:
    """Store a checkpoint losslessly: byte planes shuffled and zstd-compressed in 4 MiB
    chunks, XOR-ed first with the same bytes of --base. inspect, plan, consolidate, reshard and
    verify read the result directly; decompress restores the original files byte for byte.
    --dry-run measures the ratio on a few chunks and estimates the time, writing nothing."""
    out = Output(as_json)
    cli = state(ctx)
    with boundary(out, cli.debug):
        if dry_run:
            _show_plan(out, source, target, base, cli.settings.storage, as_json, quantize)
            return
        from ckptctl.compression.jobs import compress

        progress = out.progress()
        report = compress(source, target, base, cli.settings.storage, quantize, progress, _opener)
        if as_json:
            out.json(report.as_dict())
        else:
            _show(out, "compressed", report)


def decompress_cmd(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="Compressed checkpoint directory or URL.")],
    target: Annotated[str, typer.Argument(help="New directory or URL for the original files.")],
    as_json: Json = False,
) -> None:
    """Restore the original files of a compressed checkpoint, each checked against the
    checksum recorded when it was compressed."""
    from ckptctl.compression.jobs import decompress

    out = Output(as_json)
    cli = state(ctx)
    with boundary(out, cli.debug):
        report = decompress(source, target, cli.settings.storage, out.progress())
        if as_json:
            out.json(report.as_dict())
        else:
            _show(out, "restored", report)
