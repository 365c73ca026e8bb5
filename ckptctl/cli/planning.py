"""``ckptctl plan`` and the strategy choice behind ``reshard``: probe every stored copy, find
what is lost, let ``planners.strategy`` pick, and run a saved plan only if the source is
unchanged."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ckptctl.calibrate import calibrate, save_profile, saved_profiles
from ckptctl.cli.commands import (
    DistOpt,
    Dp,
    FirstStage,
    Full,
    Iteration,
    Json,
    LastStage,
    LostNodes,
    LostRanks,
    Pp,
    RanksPerNode,
    Replica,
    ReshardFormat,
    Strategy,
    StrategyName,
    Tp,
    TrueVocab,
    Vpp,
    _human,
    _style,
    given_sources,
    layout_choices,
    refuse_dp_reshardable,
)
from ckptctl.cli.output import Output
from ckptctl.errors import CheckpointError, UsageError
from ckptctl.locations import refuse_overlap
from ckptctl.model.geometry import nbytes
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import Plan
from ckptctl.model.stored import Format
from ckptctl.probe import (
    Checkpoint,
    changed_files,
    file_sizes,
    fingerprint,
    open_checkpoint,
    with_identities,
)
from planners.graph import overlap_graph
from planners.strategy import Stored, plan_auto


def parse_ranks(text: str | None) -> set[int]:
    """``0,3,8-11`` -> {0, 3, 8, 9, 10, 11}."""
    out: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise UsageError(f"cannot read rank list {text!r}; use e.g. 0,3,8-11") from None
    return out


def lost_files(
    ckpt: Checkpoint, ranks: set[int], nodes: set[int], ranks_per_node: int | None
) -> frozenset[str]:
    """Files lost with these global ranks (Megatron's tp-dp-pp order: DP rank 0 of each
    (tp, pp) writes its files), or with every rank of these nodes."""
    if nodes:
        if not ranks_per_node:
            raise UsageError("--lost-nodes needs --ranks-per-node")
        ranks = ranks | {n * ranks_per_node + i for n in nodes for i in range(ranks_per_node)}
    if not ranks:
        return frozenset()
    layout = ckpt.view.layout
    world = layout.tp * layout.pp * layout.dp
    if max(ranks) >= world:
        raise UsageError(f"rank {max(ranks)} is outside the source's world of {world} ranks")
    out = set()
    for g in ranks:
        tp, dp, pp = g % layout.tp, (g // layout.tp) % layout.dp, g // (layout.tp * layout.dp)
        if dp == 0:
            for f in ckpt.view.files:
                if f.rank == (tp, pp):
                    out.add(f.path)
    return frozenset(out)


def stored(ckpt: Checkpoint, url: str, lost: frozenset[str] = frozenset()) -> Stored:
    lost = lost | getattr(ckpt, "lost", frozenset())
    return Stored(
        view=ckpt.view,
        url=url,
        fingerprint=fingerprint(ckpt.storage, ckpt.view, lost),
        file_sizes=file_sizes(ckpt.storage, ckpt.view, lost),
        lost=lost,
    )


def plan_for(
    src: str,
    dst: str | None,
    wanted: dict[str, Any],
    *,
    full: list[str],
    replicas: list[str],
    lost_ranks: str | None = None,
    lost_nodes: str | None = None,
    ranks_per_node: int | None = None,
    strategy: str = "auto",
    dtype: str | None = None,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    target_format: Format = Format.MEGATRON,
) -> tuple[Plan, Checkpoint, dict[str, Checkpoint]]:
    """Probe the source and every other copy, then plan with the strategy planner."""
    others = [*full, *replicas]
    ckpt = open_checkpoint(
        src, iteration=iteration, true_vocab_size=true_vocab_size, allow_missing=bool(others)
    )
    refuse_dp_reshardable(ckpt)
    extra = [
        open_checkpoint(u, iteration=iteration, true_vocab_size=true_vocab_size) for u in others
    ]
    source = ckpt.view.layout
    layout = ParallelLayout(
        **{
            "dp": source.dp,
            "distributed_optimizer": source.distributed_optimizer,
            **{k: v for k, v in wanted.items() if v is not None},
        }
    )
    lost = lost_files(ckpt, parse_ranks(lost_ranks), parse_ranks(lost_nodes), ranks_per_node)
    primary = stored(ckpt, src, lost)
    copies = [stored(c, u) for c, u in zip(extra, others, strict=True)]
    if ckpt.view.format in (Format.MEGATRON, Format.TORCH_DIST) and ckpt.view.layout.is_sharded:
        sharded: Stored | None = primary
    else:  # a full source is cut, never copied as if it were the target
        sharded, copies = None, [primary, *copies]
    plan = plan_auto(
        sharded,
        copies,
        layout,
        target_url=dst,
        style=_style(ckpt),
        strategy=strategy,
        dtype=dtype,
        measured=saved_profiles(),
        target_format=target_format,
    )
    # The planner names further copies "@<i>/" in the order it was given them.
    given = extra if sharded is not None else [ckpt, *extra]
    by_prefix = {ref.prefix: given[int(ref.prefix[1:-1])] for ref in plan.extra_sources}
    everything = [ckpt, *extra]
    lead = next(
        c for c, url in zip(everything, [src, *others], strict=True) if url == plan.source_url
    )
    lead_lost = (lost if lead is ckpt else frozenset()) | _planned_lost(plan, lead)
    return with_identities(plan, lead.storage, lead.view, lead_lost), lead, by_prefix


def check_fresh(plan: Plan, ckpt: Checkpoint, extra: dict[str, Checkpoint]) -> None:
    """Refuse a saved plan whose source changed since it was made."""
    lost = getattr(ckpt, "lost", frozenset())
    now = fingerprint(ckpt.storage, ckpt.view, lost | _planned_lost(plan, ckpt))
    if now != plan.source_fingerprint:
        changed = changed_files(plan, ckpt.storage)
        which = f": {', '.join(changed[:3])}" if changed else ""
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise CheckpointError(
            f"{plan.source_url} changed since the plan was made{which}{more} (fingerprint "
            f"{now}, plan {plan.source_fingerprint})",
            hint="make a new plan with ckptctl plan",
        )
    for ref in plan.extra_sources:
        other = extra[ref.prefix]
        if fingerprint(other.storage, other.view) != ref.fingerprint:
            raise CheckpointError(f"{ref.url} changed since the plan was made; make a new plan")


def _planned_lost(plan: Plan, ckpt: Checkpoint) -> frozenset[str]:
    """Source files the plan treats as lost: those it neither reads nor copies."""
    used = set(plan.source_files)
    return frozenset(f.path for f in ckpt.view.files if f.path not in used)


def show(out: Output, plan: Plan) -> None:
    e = plan.estimates
    out.show(f"[bold]strategy:[/] {plan.strategy}: {plan.reason}")
    out.show(
        f"{plan.source_layout.describe()} -> {plan.target_layout.describe()}: "
        f"{len(plan.files)} files; read {_human(e.bytes_read)} in {e.read_requests} requests, "
        f"write {_human(e.bytes_written)}, peak memory ~{_human(e.peak_memory_bytes)}, "
        f"~{e.seconds:.2f} s by the cost model"
    )
    table = Table("alternative", "estimated time", "read", "requests", "why not")
    for alt in plan.alternatives:
        if alt.estimates is not None:
            a = alt.estimates
            slower = "slower" if a.seconds >= e.seconds else "not chosen"
            table.add_row(
                alt.strategy,
                f"{a.seconds:.2f} s",
                _human(a.bytes_read),
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
        top = Table("largest transfers: from", "to", "bytes")
        for (a, b), n in sorted(transfers.items(), key=lambda kv: (-kv[1], kv[0]))[:5]:
            top.add_row(a, b, _human(n))
        out.show(top)
    for note in plan.notes:
        out.warn(note)


def show_grid(out: Output, plan: Plan, svg: Path | None) -> None:
    """Which source files feed which target files: a heat map of bytes in the terminal."""
    from rich.console import Console

    t = overlap_graph(plan)
    if not t.bytes:
        out.show("no data moves")
        return
    top = max(t.bytes.values())
    shades = " ░▒▓█"
    table = Table("source \\ target", *[_short(p) for p in t.targets], show_lines=False)
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
        f"darkest = {_human(top)}; each target file reads from "
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


def load_plan(path: Path) -> Plan:
    try:
        return Plan.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--plan {path}: no such file") from None
    except ValueError as err:
        first = str(err).splitlines()[0]
        raise UsageError(f"--plan {path}: not a ckptctl plan ({first})") from None


def register(app: typer.Typer, boundary: Callable[[Output], AbstractContextManager[None]]) -> None:
    @app.command("plan")
    def plan_cmd(
        src: Annotated[str, typer.Argument(help="Stored (sharded or full) checkpoint.")],
        dst: Annotated[str | None, typer.Argument(help="Destination, if data would move.")] = None,
        tp: Tp = 1,
        pp: Pp = 1,
        vpp: Vpp = 1,
        dp: Dp = None,
        distributed_optimizer: DistOpt = None,
        first: FirstStage = None,
        last: LastStage = None,
        full: Full = None,
        replica: Replica = None,
        lost_ranks: LostRanks = None,
        lost_nodes: LostNodes = None,
        ranks_per_node: RanksPerNode = None,
        strategy: Strategy = StrategyName.auto,
        save: Annotated[
            Path | None, typer.Option("--out", help="Save the plan as JSON for --plan.")
        ] = None,
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="Accepted; plan never writes.")
        ] = True,
        show_map: Annotated[
            bool, typer.Option("--show", help="Heat map of which source files feed which targets.")
        ] = False,
        svg: Annotated[
            Path | None, typer.Option("--svg", help="Also write the map as SVG.")
        ] = None,
        target_format: ReshardFormat = Format.MEGATRON,
        as_json: Json = False,
        iteration: Iteration = None,
        true_vocab_size: TrueVocab = None,
    ) -> None:
        """Decide how to reach a layout: load shards directly, shard-to-shard, recover lost
        shards, or cut a full checkpoint; with estimates for every alternative."""
        out = Output(as_json)
        with boundary(out):
            sources = given_sources(src, full, replica)
            for what, path in (("--out file", save), ("--svg file", svg)):
                if path is not None:
                    refuse_overlap(what, str(path), sources)
            plan, _, _ = plan_for(
                src,
                dst,
                layout_choices(tp, pp, vpp, dp, first, last, distributed_optimizer),
                full=full or [],
                replicas=replica or [],
                lost_ranks=lost_ranks,
                lost_nodes=lost_nodes,
                ranks_per_node=ranks_per_node,
                strategy=strategy.value,
                iteration=iteration,
                true_vocab_size=true_vocab_size,
                target_format=target_format,
            )
            if save is not None:
                save.write_text(plan.model_dump_json(indent=1))
                out.info(f"plan saved to {save} (fingerprint {plan.fingerprint()})")
            if as_json:
                out.json(plan.model_dump(mode="json"))
            else:
                show(out, plan)
                if show_map or svg is not None:
                    show_grid(out, plan, svg)


def register_calibrate(
    app: typer.Typer, boundary: Callable[[Output], AbstractContextManager[None]]
) -> None:
    @app.command("calibrate")
    def calibrate_cmd(
        url: Annotated[
            str, typer.Argument(help="Directory or URL to measure (writes a scratch file).")
        ],
        size: Annotated[str, typer.Option("--size", help="Scratch file size.")] = "64MiB",
        save: Annotated[
            Path | None, typer.Option("--out", help="Where to save the profile [config dir].")
        ] = None,
        as_json: Json = False,
    ) -> None:
        """Measure bandwidth and latency of a storage target; later plans on that URL use it."""
        from ckptctl.cli.commands import parse_size

        out = Output(as_json)
        with boundary(out):
            profile = calibrate(url, parse_size(size))
            path = save_profile(profile, save)
            if as_json:
                out.json({**profile.model_dump(mode="json"), "saved_to": str(path)})
            else:
                out.show(
                    f"{url}: read {_human(profile.read_bandwidth)}/s, write "
                    f"{_human(profile.write_bandwidth)}/s, latency "
                    f"{profile.latency * 1e3:.2f} ms; saved to {path}"
                )


def register_verify(
    app: typer.Typer, boundary: Callable[[Output], AbstractContextManager[None]]
) -> None:
    @app.command("verify")
    def verify_cmd(
        ckpt: Annotated[str, typer.Argument(help="Checkpoint directory or URL.")],
        numerics: Annotated[bool, typer.Option("--numerics", help="Scan for NaN/Inf.")] = False,
        other: Annotated[
            str | None,
            typer.Option("--against", help="Compare every tensor with this checkpoint."),
        ] = None,
        rtol: Annotated[float, typer.Option("--rtol", help="Relative tolerance.")] = 0.0,
        atol: Annotated[float, typer.Option("--atol", help="Absolute tolerance.")] = 0.0,
        as_json: Json = False,
    ) -> None:
        """Check a checkpoint is whole: completion marker, manifest sizes and checksums, structure,
        coverage of every tensor, (--numerics) finite values, and (--against B) equal to B tensor
        by tensor in any layout or format. Exit 0 all passed, 1 a check failed, 2 usage, 3 bad
        input, 4 storage error."""
        from ckptctl.verify import against, verify
        from ckptctl.verify import as_json as report_json

        out = Output(as_json)
        with boundary(out):
            checks = verify(ckpt, numerics=numerics)
            tensors: list[dict] = []
            if other is not None:
                check, tensors = against(ckpt, other, rtol=rtol, atol=atol)
                checks.append(check)
            report = report_json(checks)
            if tensors:
                report["tensors"] = tensors
            if as_json:
                out.json(report)
            else:
                colour = {"passed": "green", "failed": "red", "skipped": "yellow"}
                for c in checks:
                    out.show(f"[{colour[c.status]}]{c.status:>7}[/] {c.name}: {c.detail}")
            if not report["ok"]:
                raise typer.Exit(1)
