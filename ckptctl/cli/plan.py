"""``ckptctl plan``: what would happen and why: the strategy chosen by the cost model, every
alternative with its estimate or the reason it cannot be used, the largest transfers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ckptctl.cli.options import (
    Iteration,
    Json,
    TargetRequest,
    TrueVocab,
    state,
    target_request,
    with_options,
)
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.units import human_bytes
from ckptctl.io.locations import refuse_overlap
from ckptctl.model.geometry import nbytes
from ckptctl.model.plan import Plan
from ckptctl.pipeline.jobs import Job, given_sources, pipeline_window, plan_reshard
from planners.graph import overlap_graph
from planners.shares import parallel_seconds, share_bytes, split_files


@with_options(target_request, "target")
def plan_cmd(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="Stored (sharded or full) checkpoint.")],
    dst: Annotated[str | None, typer.Argument(help="Destination, if data would move.")] = None,
    target: TargetRequest | None = None,
    save: Annotated[
        Path | None, typer.Option("--out", help="Save the plan as JSON for --plan.")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", hidden=True, help="Accepted; plan never writes.")
    ] = True,
    show_map: Annotated[
        bool, typer.Option("--show", help="Heat map of which source files feed which targets.")
    ] = False,
    svg: Annotated[Path | None, typer.Option("--svg", help="Also write the map as SVG.")] = None,
    as_json: Json = False,
    iteration: Iteration = None,
    true_vocab_size: TrueVocab = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            help="Also show how this many processes (or nodes) would share the job's files.",
        ),
    ] = 1,
) -> None:
    """Decide how to reach a layout: load shards directly, shard-to-shard, recover lost
    shards, or cut a full checkpoint; with estimates for every alternative."""
    out = Output(as_json)
    cli = state(ctx)
    with boundary(out, cli.debug):
        assert target is not None
        sources = given_sources(src, target.full, target.replicas)
        for what, path in (("--out file", save), ("--svg file", svg)):
            if path is not None:
                refuse_overlap(what, str(path), sources)
        job = plan_reshard(
            src,
            dst,
            target.layout,
            cli.settings,
            iteration=iteration,
            true_vocab_size=true_vocab_size,
            **target.plan_options(),
        )
        plan = job.plan
        shares = worker_shares(job, workers) if workers > 1 else None
        if save is not None:
            with save.open("w") as saved:
                saved.writelines(plan.json_parts())
            out.info(f"plan saved to {save} (fingerprint {plan.fingerprint()})")
        if as_json:
            out.json_parts(plan.json_parts({"workers": shares} if shares else None))
        else:
            show(out, plan)
            if shares:
                show_shares(out, shares)
            if show_map or svg is not None:
                show_grid(out, plan, svg)


def worker_shares(job: Job, workers: int) -> dict[str, Any]:
    """What each of ``workers`` processes would write, and the cost model's time for them on
    one machine (storage shared) and on as many nodes (each with its own disk and NIC)."""
    plan = job.plan
    sizes = [job.sources.file_bytes(plan, f) for f in plan.files]
    shares = split_files(plan.files, sizes, workers)
    seconds, pipeline = plan.estimates.seconds, plan.estimates.pipeline_seconds
    one_node = parallel_seconds(seconds, sizes, shares, shared_storage=True)
    window = pipeline_window(job.settings, plan.target_url)
    nodes = parallel_seconds(seconds, sizes, shares, False, pipeline=pipeline, window=window)
    return {
        "count": workers,
        "shares": [
            {"rank": r, "files": [plan.files[i].path for i in share], "bytes": n}
            for r, (share, n) in enumerate(zip(shares, share_bytes(sizes, shares), strict=True))
        ],
        "seconds_one_process": seconds,
        "seconds_one_machine": one_node,
        "seconds_one_node_each": nodes,
    }


def show_shares(out: Output, shares: dict[str, Any]) -> None:
    table = out.table("rank", "files", "bytes")
    for share in shares["shares"]:
        table.add_row(str(share["rank"]), str(len(share["files"])), human_bytes(share["bytes"]))
    out.show(table)
    one, machine, nodes = (
        shares[k] for k in ("seconds_one_process", "seconds_one_machine", "seconds_one_node_each")
    )
    out.show(
        f"cost model: ~{one:.2f} s on one process; {shares['count']} processes on this machine "
        f"share its storage bandwidth: ~{machine:.2f} s; on {shares['count']} nodes each with "
        f"its own disk and NIC: ~{nodes:.2f} s ({one / nodes if nodes else 1:.1f}x)"
    )


def show(out: Output, plan: Plan) -> None:
    e = plan.estimates
    out.show(f"[bold]strategy:[/] {plan.strategy}: {plan.reason}")
    out.show(
        f"{plan.source_layout.describe()} -> {plan.target_layout.describe()}: "
        f"{len(plan.files)} files; read {human_bytes(e.bytes_read)} in {e.read_requests} requests, "
        f"write {human_bytes(e.bytes_written)}, peak memory ~{human_bytes(e.peak_memory_bytes)}, "
        f"~{e.seconds:.2f} s by the cost model"
    )
    table = out.table("alternative", "estimated time", "read", "requests", "why not")
    for alt in plan.alternatives:
        if alt.estimates is not None:
            a = alt.estimates
            slower = "slower" if a.seconds >= e.seconds else "not chosen"
            table.add_row(
                alt.strategy,
                f"{a.seconds:.2f} s",
                human_bytes(a.bytes_read),
                str(a.read_requests),
                slower,
            )
        else:
            table.add_row(alt.strategy, "-", "-", "-", alt.refused or "")
    out.show(table)
    transfers: dict[tuple[str, str], int] = {}
    for file in plan.files:
        for tensor in file.tensors:
            for copy in tensor.copies:
                key = (plan.source_files[copy.source], file.path)
                transfers[key] = transfers.get(key, 0) + nbytes(copy.sizes, tensor.dtype)
    if transfers:
        top = out.table("largest transfers: from", "to", "bytes")
        for (src, dst), n in sorted(transfers.items(), key=lambda kv: (-kv[1], kv[0]))[:5]:
            top.add_row(src, dst, human_bytes(n))
        out.show(top)
    for note in plan.notes:
        out.note(note)
    for warning in plan.warnings:
        out.warn(warning)


def show_grid(out: Output, plan: Plan, svg: Path | None) -> None:
    """Which source files feed which target files: a heat map of bytes in the terminal."""
    from rich.console import Console

    t = overlap_graph(plan)
    if not t.bytes:
        out.show("no data moves")
        return
    top = max(t.bytes.values())
    shades = " ░▒▓█"
    table = out.table("source \\ target", *[_short(p) for p in t.targets], show_lines=False)
    for source in t.sources:
        cells = []
        for target in t.targets:
            n = t.bytes.get((source, target), 0)
            level = 0 if n == 0 else 1 + min(3, int(4 * n / (top + 1)))
            cells.append(f"[cyan]{shades[level] * 3}[/]" if n else "   ")
        table.add_row(_short(source), *cells)
    console = Console(record=True, file=out.out.file)
    console.print(table)
    console.print(
        f"darkest = {human_bytes(top)}; each target file reads from "
        f"{max(t.fan_in(x) for x in t.targets)} source files at most"
    )
    if svg is not None:
        console.save_svg(str(svg), title=f"ckptctl plan: {plan.strategy}")
        out.info(f"heat map written to {svg}")


def _short(path: str) -> str:
    """``iter_0000001/mp_rank_01_002/distrib_optim.pt`` -> ``01_002 opt``."""
    parts = path.split("/")
    name = parts[-2].removeprefix("mp_rank_") if len(parts) > 1 else parts[-1]
    prefix = parts[0] + " " if parts[0].startswith("@") else ""
    return prefix + name + (" opt" if parts[-1] == "distrib_optim.pt" else "")
