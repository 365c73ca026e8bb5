"""The ``inspect`` and ``consolidate`` commands (and the shared option aliases)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from contextvars import ContextVar
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ByteSize, TypeAdapter
from rich.table import Table

from ckptctl.cli.output import Output, RichProgress, human_bytes
from ckptctl.errors import CkptctlError, OutputExistsError, UsageError
from ckptctl.execute import DEFAULT_MEMORY_BUDGET, Report, Sources, execute
from ckptctl.formats.dcp import DcpCheckpoint
from ckptctl.formats.megatron import MegatronCheckpoint
from ckptctl.formats.megatron_layout import MegatronStyle
from ckptctl.locations import refuse_overlap
from ckptctl.manifest import INCOMPLETE, completed_by, foreign_files, read_marker
from ckptctl.model.catalog import OPTIMIZER_STATES
from ckptctl.model.geometry import nbytes
from ckptctl.model.plan import Plan
from ckptctl.model.stored import Format
from ckptctl.probe import Checkpoint, fingerprint, open_checkpoint, with_identities
from ckptctl.staging import StagedStorage
from ckptctl.storage import Storage
from ckptctl.storage_errors import check_free_space, classify
from planners.consolidate import plan_consolidate, plan_state_dict


class DType(StrEnum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


_DTYPES = {DType.bf16: "bfloat16", DType.fp16: "float16", DType.fp32: "float32"}

WeightDType = Annotated[
    DType | None, typer.Option("--dtype", help="Convert weights (optimizer stays fp32).")
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
Iteration = Annotated[
    int | None, typer.Option("--iteration", help="Iteration to read instead of the tracker's.")
]
TrueVocab = Annotated[
    int | None,
    typer.Option(
        "--true-vocab-size",
        help="Real vocabulary size when args do not record it (padding rows are dropped).",
    ),
]
MemoryBudget = Annotated[
    str,
    typer.Option("--memory-budget", help="Tensor data held in memory at once (e.g. 512MiB, 2GiB)."),
]
Tp = Annotated[int, typer.Option("--tp", help="Target tensor-parallel size.")]
Pp = Annotated[int, typer.Option("--pp", help="Target pipeline-parallel size.")]
Vpp = Annotated[int, typer.Option("--vpp", help="Virtual pipeline chunks per stage.")]
Dp = Annotated[int | None, typer.Option("--dp", help="Target data-parallel size [source's].")]
DistOpt = Annotated[
    bool | None,
    typer.Option(
        "--distributed-optimizer/--no-distributed-optimizer",
        help="Write optimizer state as distrib_optim.pt [as the source].",
    ),
]
FirstStage = Annotated[
    int | None, typer.Option("--pp-first-stage-layers", help="Layers on the first stage.")
]
LastStage = Annotated[
    int | None, typer.Option("--pp-last-stage-layers", help="Layers on the last stage.")
]
Full = Annotated[
    list[str] | None,
    typer.Option("--full", help="A full checkpoint of the same state (HF or TP1 PP1)."),
]
Replica = Annotated[
    list[str] | None,
    typer.Option("--replica", help="Another stored copy of the same sharded checkpoint."),
]
LostRanks = Annotated[
    str | None, typer.Option("--lost-ranks", help="Global ranks whose files are lost: 0,3,8-11.")
]
LostNodes = Annotated[
    str | None,
    typer.Option("--lost-nodes", help="Nodes whose files are lost (with --ranks-per-node)."),
]
RanksPerNode = Annotated[int | None, typer.Option("--ranks-per-node", help="Ranks per node.")]


class StrategyName(StrEnum):
    auto = "auto"
    direct = "direct"
    shard_to_shard = "shard-to-shard"
    recovery = "recovery"
    full_then_split = "full-then-split"


Strategy = Annotated[
    StrategyName,
    typer.Option("--strategy", help="How to reach the target (auto: the cheapest valid one)."),
]
PlanFile = Annotated[
    Path | None, typer.Option("--plan", help="Run exactly this saved plan (from ckptctl plan).")
]


class ChecksumName(StrEnum):
    xxh3_64 = "xxh3_64"
    sha256 = "sha256"


CHECKSUM_CHOICE: ContextVar[str] = ContextVar("checksum", default="xxh3_64")
STAGE_DIR: ContextVar[str | None] = ContextVar("stage_dir", default=None)
ReshardFormat = Annotated[
    Format,
    typer.Option(
        "--format",
        help="megatron: legacy mp_rank_* files; torch_dist: Megatron-Core's DCP format.",
    ),
]
REMOTE_READ_PARALLEL = 8
StageDir = Annotated[
    str | None,
    typer.Option(
        "--stage-dir",
        help="Write files to this local directory first and upload them in the background; "
        "the manifest goes up after the last upload.",
    ),
]
Checksum = Annotated[
    ChecksumName,
    typer.Option("--checksum", help="File checksum recorded in the manifest."),
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Plan only; write nothing.")]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Replace an existing checkpoint at the destination.")
]


_human = human_bytes


def layout_choices(
    tp: int,
    pp: int,
    vpp: int,
    dp: int | None,
    first: int | None,
    last: int | None,
    distributed_optimizer: bool | None,
) -> dict[str, Any]:
    """The target layout as given on the command line; ``None`` keeps the source's choice."""
    return {
        "tp": tp,
        "pp": pp,
        "vpp": vpp,
        "dp": dp,
        "first_stage_layers": first,
        "last_stage_layers": last,
        "distributed_optimizer": distributed_optimizer,
    }


def parse_size(text: str) -> int:
    """``512MiB``, ``2GiB``, ``5GB``, ``1000`` -> bytes (pydantic's ``ByteSize`` reads them)."""
    try:
        return int(_BYTE_SIZE.validate_python(text.strip()))
    except ValueError:
        raise UsageError(f"cannot read size {text!r}; use e.g. 512MiB or 2GiB") from None


_BYTE_SIZE = TypeAdapter(ByteSize)


def describe(ckpt: Checkpoint) -> dict[str, Any]:
    view = ckpt.view
    files = []
    weights = optimizer = 0
    count = 0
    for f in view.files:
        file_total = 0
        for t in f.tensors:
            size = nbytes(t.shape, t.dtype)
            file_total += size
            count += 1
            if t.canonical.split("/", 1)[0] in OPTIMIZER_STATES:
                optimizer += size
            else:
                weights += size
        files.append(
            {
                "path": f.path,
                "rank": f.rank,
                "tensors": len(f.tensors),
                "tensor_bytes": file_total,
                "file_bytes": ckpt.storage.size(f.path),
            }
        )
    return {
        "url": ckpt.storage.url,
        "format": view.format.value,
        "iteration": view.iteration,
        "spec": view.spec.model_dump(mode="json") if view.spec else None,
        "layout": view.layout.model_dump(mode="json"),
        "tensors": count,
        "weight_bytes": weights,
        "optimizer_bytes": optimizer,
        "has_optimizer": view.has_optimizer,
        "files": files,
        "notes": list(view.notes),
    }


def _show_inspect(out: Output, info: dict[str, Any]) -> None:
    spec, layout = info["spec"], info["layout"]
    out.show(f"[bold]{info['url']}[/]  {info['format']}  iteration {info['iteration']}")
    if spec is None:
        out.show("model: unknown family (keys are not Megatron-Core's or HF Llama's)")
    else:
        out.show(
            f"model: {spec['num_layers']} layers, hidden {spec['hidden_size']}, ffn "
            f"{spec['ffn_hidden_size']}, heads {spec['num_attention_heads']} "
            f"(query groups {spec['num_query_groups']}, head dim {spec['kv_channels']}), vocab "
            f"{spec['vocab_size']}, {'SwiGLU' if spec['gated_linear_unit'] else 'MLP'}, "
            f"{spec['normalization']}, {'tied' if spec['tie_embeddings'] else 'untied'} "
            "embeddings"
        )
    out.show("layout: " + " ".join(f"{k}={v}" for k, v in layout.items() if v not in (None, False)))
    table = Table("file", "rank (tp, pp)", "tensors", "bytes")
    for f in info["files"]:
        table.add_row(
            f["path"],
            str(tuple(f["rank"])) if f["rank"] else "-",
            str(f["tensors"]),
            _human(f["file_bytes"]),
        )
    out.show(table)
    out.show(
        f"{info['tensors']} tensors: weights {_human(info['weight_bytes'])}, optimizer state "
        f"{_human(info['optimizer_bytes'])}"
    )
    for note in info["notes"]:
        out.warn(note)


def _check_target(url: str, overwrite: bool, fingerprint: str) -> Storage | None:
    """Validate the destination before anything is written or warned about.

    Returns the storage to clear first (``--overwrite`` of a previous ckptctl output, or debris
    of a run killed before it wrote anything), or ``None`` if the destination can be written as
    it is (absent, empty, or an interrupted run of this very plan, which is resumed)."""
    target = Storage(url)
    if not target.exists():
        return None
    if not target.isdir():
        raise OutputExistsError(
            f"{url} is a file, not a directory", hint="choose a directory as the destination"
        )
    marker = read_marker(target)
    if marker and marker.get("plan_fingerprint") == fingerprint and not overwrite:
        return None  # an interrupted run of this very plan: resume it
    files = target.find_files()
    # Leftovers of a run killed before it wrote anything are not content.
    if set(files) <= {INCOMPLETE, INCOMPLETE + ".partial"}:
        return target if files else None
    if not overwrite:
        raise OutputExistsError(
            f"{url} exists and is not empty",
            hint="pass --overwrite to replace a previous ckptctl output, or choose another "
            "destination",
        )
    foreign = foreign_files(target, files)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise OutputExistsError(
            f"--overwrite: {url} holds {foreign[0]}{more}, which no ckptctl job wrote; "
            "ckptctl only replaces its own outputs",
            hint="remove those files yourself or choose another destination",
        )
    return target


def _report_dict(plan: Plan, report: Report) -> dict[str, Any]:
    return {
        "operation": plan.operation,
        "source": plan.source_url,
        "target": plan.target_url,
        "target_format": plan.target_format.value,
        "target_layout": plan.target_layout.model_dump(mode="json"),
        "plan_fingerprint": plan.fingerprint(),
        "files": report.files_written,
        "bytes_read": report.bytes_read,
        "read_requests": report.read_requests,
        "strategy": plan.strategy,
        "estimates": plan.estimates.model_dump(mode="json"),
        "bytes_written": report.bytes_written,
        "seconds": round(report.seconds, 3),
        "throughput_bytes_per_s": int(report.bytes_written / report.seconds)
        if report.seconds
        else 0,
        "peak_rss_bytes": report.peak_rss_bytes,
        "notes": list(plan.notes),
    }


def register(app: typer.Typer, boundary: Callable[[Output], AbstractContextManager[None]]) -> None:
    @app.command("inspect")
    def inspect_cmd(
        src: Annotated[str, typer.Argument(help="Checkpoint directory or URL.")],
        as_json: Json = False,
        iteration: Iteration = None,
        true_vocab_size: TrueVocab = None,
    ) -> None:
        """Show format, iteration, model, layout, files and sizes of a checkpoint."""
        out = Output(as_json)
        with boundary(out):
            info = describe(
                open_checkpoint(src, iteration=iteration, true_vocab_size=true_vocab_size)
            )
            out.json(info) if as_json else _show_inspect(out, info)

    @app.command("consolidate")
    def consolidate_cmd(
        src: Annotated[str, typer.Argument(help="Sharded checkpoint directory or URL.")],
        dst: Annotated[str, typer.Argument(help="Destination directory or URL.")],
        fmt: Annotated[
            Format,
            typer.Option(
                "--format",
                help="hf: safetensors weights; megatron: TP1 PP1; torch: one state_dict.pt "
                "(DCP sources).",
            ),
        ] = Format.HF,
        dtype: WeightDType = None,
        max_shard_size: Annotated[
            str, typer.Option("--max-shard-size", help="Largest HF safetensors file.")
        ] = "5GiB",
        plan_file: PlanFile = None,
        memory_budget: MemoryBudget = "1GiB",
        checksum: Checksum = ChecksumName.xxh3_64,
        stage_dir: StageDir = None,
        dry_run: DryRun = False,
        overwrite: Overwrite = False,
        as_json: Json = False,
        iteration: Iteration = None,
        true_vocab_size: TrueVocab = None,
    ) -> None:
        """Merge a sharded checkpoint into one full checkpoint, streaming one tensor at a time."""
        CHECKSUM_CHOICE.set(checksum.value)
        STAGE_DIR.set(stage_dir)
        out = Output(as_json)
        with boundary(out):
            plan, report = run_consolidate(
                out,
                src,
                dst,
                fmt,
                dtype=_DTYPES[dtype] if dtype else None,
                max_shard_bytes=parse_size(max_shard_size),
                memory_budget=parse_size(memory_budget),
                dry_run=dry_run,
                overwrite=overwrite,
                iteration=iteration,
                true_vocab_size=true_vocab_size,
                plan_file=plan_file,
            )
            _finish(out, plan, report, as_json)


def refuse_dp_reshardable(ckpt: Checkpoint) -> None:
    """``dp_reshardable`` optimizer state is raw grad-buffer buckets of one TP/PP/DP layout,
    which only Megatron itself loads, and only at that layout."""
    if isinstance(ckpt, DcpCheckpoint) and ckpt.dp_reshardable:
        raise UsageError(
            f"{ckpt.storage.url}: optimizer state is dp_reshardable (grad-buffer buckets of the "
            f"saved {ckpt.view.layout.describe()} layout), so it cannot move to another TP/PP "
            "layout or format; re-save it with --dist-ckpt-optim-fully-reshardable, or take the "
            "weights alone with consolidate --format hf"
        )


def _style(ckpt: Checkpoint) -> MegatronStyle:
    """Spelling, order and optimizer format to keep when writing Megatron files."""
    if isinstance(ckpt, MegatronCheckpoint):
        return MegatronStyle(ckpt.naming, ckpt.layer_order, ckpt.optimizer)
    if isinstance(ckpt, DcpCheckpoint):
        return MegatronStyle(optimizer=ckpt.optimizer)
    return MegatronStyle()


def given_sources(
    src: str, full: list[str] | None = None, replicas: list[str] | None = None
) -> dict[str, str | None]:
    """The checkpoints named on the command line, labelled for error messages."""
    sources: dict[str, str | None] = {"source": src}
    for label, urls in (("--full checkpoint", full), ("--replica", replicas)):
        sources.update({label + (f" {i + 1}" if i else ""): u for i, u in enumerate(urls or [])})
    return sources


def _plan_sources(plan: Plan) -> dict[str, str | None]:
    """Every stored checkpoint a plan reads, by the label an error message should use."""
    sources: dict[str, str | None] = {"source": plan.source_url}
    for ref in plan.extra_sources:
        sources[f"source copy ({ref.prefix})"] = ref.url
    return sources


def _resumable_bytes(plan: Plan) -> int:
    """Bytes an interrupted run of this plan already wrote at its destination (kept on resume)."""
    target = Storage(plan.target_url)
    marker = read_marker(target) if target.isdir() else None
    if not marker or marker.get("plan_fingerprint") != plan.fingerprint():
        return 0
    return sum(int(entry.get("size", 0)) for entry in marker.get("done", {}).values())


def _warn_notes(out: Output, plan: Plan, quiet: bool) -> None:
    if not quiet:
        for note in plan.notes:
            out.warn(note)


def _carry_out(
    out: Output,
    ckpt: Checkpoint | Sources,
    plan: Plan,
    overwrite: bool,
    memory_budget: int,
    dry_run: bool,
    quiet: bool,
) -> Report | None:
    """Check the destination, warn about the plan's notes, then execute the plan unless this is
    a dry run. Nothing is written (and no warning printed) before every check has passed."""
    refuse_overlap("destination", plan.target_url, _plan_sources(plan))
    stage_dir = STAGE_DIR.get()
    if stage_dir is not None:
        refuse_overlap("--stage-dir", stage_dir, _plan_sources(plan))
    if dry_run:
        _warn_notes(out, plan, quiet)
        return None
    if not overwrite and completed_by(plan.target_url, plan.fingerprint()):
        out.info(f"{plan.target_url} is already complete for this plan; nothing to do")
        return Report(files_written=[])
    to_clear = _check_target(plan.target_url, overwrite, plan.fingerprint())
    check_free_space(plan.target_url, plan.estimates.bytes_written - _resumable_bytes(plan))
    _warn_notes(out, plan, quiet)
    if to_clear is not None:
        to_clear.remove("")
    target = Storage(plan.target_url)
    if stage_dir is not None:
        target = StagedStorage(target, stage_dir)
    workers = plan.read_workers
    if not Storage(plan.source_url).is_local:
        # Object stores answer each ranged GET after a round trip: keep several in flight.
        workers = max(workers, REMOTE_READ_PARALLEL)
    progress = RichProgress(out.err, enabled=not (out.as_json or quiet))
    try:
        return execute(
            plan,
            ckpt,
            target,
            progress,
            memory_budget,
            workers=workers,
            checksum=CHECKSUM_CHOICE.get(),
        )
    except CkptctlError:
        raise
    except Exception as err:
        storage = classify(err, f"{plan.source_url} -> {plan.target_url}")
        if storage is None:
            raise
        raise storage from err
    finally:
        if isinstance(target, StagedStorage):
            target.close()


def _finish(out: Output, plan: Plan, report: Report | None, as_json: bool) -> None:
    """The plan (dry run) or the summary of what was done, as text or one JSON document."""
    if report is None:
        _show_plan(out, plan, as_json)
    elif as_json:
        out.json(_report_dict(plan, report))
    else:
        target = plan.target_layout.describe()
        if plan.target_format is Format.HF:
            target = "HF safetensors"
        out.show(
            f"{plan.operation}: {plan.source_url} ({plan.source_layout.describe()}) -> "
            f"{plan.target_url} ({target}): {len(report.files_written)} files, read "
            f"{_human(report.bytes_read)}, wrote {_human(report.bytes_written)} in "
            f"{report.seconds:.1f} s, peak RSS {_human(report.peak_rss_bytes)}"
        )


def _saved_plan(
    plan_file: Path,
    operation: str,
    src: str,
    dst: str,
    iteration: int | None,
    true_vocab_size: int | None,
) -> tuple[Plan, Sources]:
    """Load a saved plan for exactly this source and destination, if the source is unchanged."""
    from ckptctl.cli import planning

    plan = planning.load_plan(plan_file)
    if plan.operation != operation:
        raise UsageError(f"--plan {plan_file} is a {plan.operation} plan, not a {operation} one")
    if (plan.source_url, plan.target_url) != (src, dst):
        raise UsageError(
            f"--plan {plan_file} was made for {plan.source_url} -> {plan.target_url}, "
            f"not {src} -> {dst}"
        )
    ckpt = open_checkpoint(
        src, iteration=iteration, true_vocab_size=true_vocab_size, allow_missing=True
    )
    extra = {r.prefix: open_checkpoint(r.url) for r in plan.extra_sources}
    planning.check_fresh(plan, ckpt, extra)
    return plan, Sources(ckpt, extra)


def run_consolidate(
    out: Output,
    src: str,
    dst: str,
    fmt: Format,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 << 30,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    dry_run: bool = False,
    overwrite: bool = False,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    plan_file: Path | None = None,
    quiet: bool = False,
) -> tuple[Plan, Report | None]:
    """Probe ``src``, plan the consolidation (or load ``plan_file``) and execute it."""
    refuse_overlap("destination", dst, {"source": src})
    if plan_file is not None:
        plan, sources = _saved_plan(plan_file, "consolidate", src, dst, iteration, true_vocab_size)
        return plan, _carry_out(out, sources, plan, overwrite, memory_budget, dry_run, quiet)
    ckpt = open_checkpoint(src, iteration=iteration, true_vocab_size=true_vocab_size)
    if fmt is Format.TORCH:
        if not isinstance(ckpt, DcpCheckpoint):
            raise UsageError("--format torch consolidates DCP / torch_dist checkpoints")
        generic = ckpt.as_generic()
        plan = plan_state_dict(
            generic.view,
            source_url=src,
            source_fingerprint=fingerprint(ckpt.storage, generic.view),
            target_url=dst,
        )
        plan = with_identities(plan, ckpt.storage, generic.view)
        return plan, _carry_out(out, generic, plan, overwrite, memory_budget, dry_run, quiet)
    if fmt not in (Format.HF, Format.MEGATRON):
        raise UsageError(f"consolidate --format {fmt.value}: choose hf, megatron or torch")
    if fmt is not Format.HF:
        refuse_dp_reshardable(ckpt)
    plan = plan_consolidate(
        ckpt.view,
        source_url=src,
        source_fingerprint=fingerprint(ckpt.storage, ckpt.view),
        target_url=dst,
        target_format=fmt,
        style=_style(ckpt),
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
    )
    plan = with_identities(plan, ckpt.storage, ckpt.view)
    return plan, _carry_out(out, ckpt, plan, overwrite, memory_budget, dry_run, quiet)


def run_reshard(
    out: Output,
    src: str,
    dst: str,
    wanted: dict[str, Any],
    *,
    full: list[str] | None = None,
    replicas: list[str] | None = None,
    lost_ranks: str | None = None,
    lost_nodes: str | None = None,
    ranks_per_node: int | None = None,
    strategy: str = "auto",
    plan_file: Path | None = None,
    dtype: str | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    dry_run: bool = False,
    overwrite: bool = False,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    quiet: bool = False,
    target_format: Format = Format.MEGATRON,
) -> tuple[Plan, Report | None]:
    """Probe every stored copy, choose a strategy (or load ``plan_file``) and execute it."""
    from ckptctl.cli import planning

    refuse_overlap("destination", dst, given_sources(src, full, replicas))
    if plan_file is not None:
        plan, sources = _saved_plan(plan_file, "reshard", src, dst, iteration, true_vocab_size)
        return plan, _carry_out(out, sources, plan, overwrite, memory_budget, dry_run, quiet)
    else:
        plan, ckpt, extra = planning.plan_for(
            src,
            dst,
            wanted,
            full=full or [],
            replicas=replicas or [],
            lost_ranks=lost_ranks,
            lost_nodes=lost_nodes,
            ranks_per_node=ranks_per_node,
            strategy=strategy,
            dtype=dtype,
            iteration=iteration,
            true_vocab_size=true_vocab_size,
            target_format=target_format,
        )
    sources = Sources(ckpt, extra)
    return plan, _carry_out(out, sources, plan, overwrite, memory_budget, dry_run, quiet)


def register_reshard(
    app: typer.Typer, boundary: Callable[[Output], AbstractContextManager[None]]
) -> None:
    @app.command("reshard")
    def reshard_cmd(
        src: Annotated[str, typer.Argument(help="Checkpoint directory or URL (sharded or full).")],
        dst: Annotated[str, typer.Argument(help="Destination directory or URL.")],
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
        via_full: Annotated[
            str | None,
            typer.Option(
                "--via-full",
                help="Consolidate into this directory first (kept as a topology-free backup), "
                "then cut the target from it.",
            ),
        ] = None,
        plan_file: PlanFile = None,
        memory_budget: MemoryBudget = "1GiB",
        dtype: WeightDType = None,
        checksum: Checksum = ChecksumName.xxh3_64,
        stage_dir: StageDir = None,
        target_format: ReshardFormat = Format.MEGATRON,
        dry_run: DryRun = False,
        overwrite: Overwrite = False,
        as_json: Json = False,
        iteration: Iteration = None,
        true_vocab_size: TrueVocab = None,
    ) -> None:
        """Re-split a checkpoint for another TP/PP/VPP/DP layout, shard to shard."""
        CHECKSUM_CHOICE.set(checksum.value)
        STAGE_DIR.set(stage_dir)
        out = Output(as_json)
        with boundary(out):
            sources = given_sources(src, full, replica)
            refuse_overlap("destination", dst, sources)
            if via_full is not None:
                if dry_run or plan_file is not None:
                    raise UsageError("--via-full runs two steps; it takes no --dry-run or --plan")
                refuse_overlap("--via-full directory", via_full, sources)
                refuse_overlap("destination", dst, {"--via-full directory": via_full})
                run_consolidate(
                    out,
                    src,
                    via_full,
                    Format.MEGATRON,
                    overwrite=overwrite,
                    memory_budget=parse_size(memory_budget),
                    iteration=iteration,
                    true_vocab_size=true_vocab_size,
                    quiet=as_json,
                )
                src = via_full
            plan, report = run_reshard(
                out,
                src,
                dst,
                layout_choices(tp, pp, vpp, dp, first, last, distributed_optimizer),
                full=full,
                replicas=replica,
                lost_ranks=lost_ranks,
                lost_nodes=lost_nodes,
                ranks_per_node=ranks_per_node,
                strategy=strategy.value,
                plan_file=plan_file,
                dtype=_DTYPES[dtype] if dtype else None,
                memory_budget=parse_size(memory_budget),
                dry_run=dry_run,
                overwrite=overwrite,
                iteration=iteration,
                true_vocab_size=true_vocab_size,
                target_format=target_format,
            )
            _finish(out, plan, report, as_json)


def _show_plan(out: Output, plan: Plan, as_json: bool) -> None:
    if as_json:
        out.json(plan.model_dump(mode="json"))
        return
    e = plan.estimates
    out.show(
        f"{plan.operation} {plan.source_url} -> {plan.target_url}: {plan.strategy}: {plan.reason}\n"
        f"{len(plan.files)} files; read {_human(e.bytes_read)} in {e.read_requests} requests, "
        f"write {_human(e.bytes_written)}, peak memory ~{_human(e.peak_memory_bytes)}"
    )
