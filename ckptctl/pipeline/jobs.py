"""Jobs: plan a consolidation or a reshard (or load a saved plan), then run it.

This is the library's front door; the CLI is a thin layer over it (README, "Python API")::

    settings = Settings()
    job = plan_consolidate("ckpt/", "out/", "hf", settings)
    destination = check_destination(job.plan, settings)   # validates; writes nothing
    report = run(job, destination)

Planning probes every stored copy read-only and asks ``planners`` for the plan; running checks
the destination and hands the plan to the executor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptctl.checksums.manifest import completed_by
from ckptctl.compression.view import CompressedStorage
from ckptctl.errors import CheckpointError, CkptctlError, UsageError
from ckptctl.formats import registry
from ckptctl.formats.megatron_common.ranks import coords
from ckptctl.formats.target import CONSOLIDATE, RESHARD
from ckptctl.formats.torch_dist.optimizer_form import form_change_notes, optimizer_form, source_form
from ckptctl.io.calibrate import saved_profiles
from ckptctl.io.locations import refuse_overlap
from ckptctl.io.staging import StagedStorage
from ckptctl.io.storage import WRITEBACK_STEP
from ckptctl.io.storage_errors import classify
from ckptctl.model.megatron_style import MegatronStyle
from ckptctl.model.plan import Plan, smallest_band
from ckptctl.model.target import TargetRequest
from ckptctl.pipeline.destination import Destination, check_destination
from ckptctl.pipeline.distributed import Group
from ckptctl.pipeline.job_report import Report, Sources
from ckptctl.pipeline.lease import LOCK, hold
from ckptctl.pipeline.probe import (
    Checkpoint,
    changed_files,
    file_sizes,
    fingerprint,
    open_checkpoint,
    open_sources,
    with_identities,
)
from ckptctl.pipeline.request_checks import (
    refuse_dp_reshardable,
    refuse_needless_rounding,
    refuse_unmeshed,
    refuse_unwritable_dtype,
)
from ckptctl.progress import Progress
from ckptctl.settings import Settings, default_files_at_once, default_read_parallel
from planners.consolidate import plan_consolidate as consolidation
from planners.cost import is_local, profile_for, through_decoder, with_time
from planners.strategy import Stored, plan_auto
from planners.target import choose_target

DEFAULT_RESHARD_FORMAT = "megatron"
"""What a reshard writes from a source whose format holds no layouts (HF, DCP, DeepSpeed)."""

__all__ = ["Destination", "Job", "check_destination", "plan_consolidate", "plan_reshard", "run"]


@dataclass
class Job:
    """A plan and the opened checkpoints it reads, ready to run."""

    plan: Plan
    sources: Sources
    settings: Settings


def given_sources(
    src: str, full: list[str] | None = None, replicas: list[str] | None = None
) -> dict[str, str | None]:
    """The checkpoints a job is asked to read, labelled for error messages."""
    sources: dict[str, str | None] = {"source": src}
    for label, urls in (("--full checkpoint", full), ("--replica", replicas)):
        sources.update({label + (f" {i + 1}" if i else ""): u for i, u in enumerate(urls or [])})
    return sources


def megatron_style(ckpt: Checkpoint) -> MegatronStyle:
    """Spelling, order and optimizer format to keep when writing Megatron files (a source
    that has none gets the defaults)."""
    return ckpt.style or MegatronStyle()


def plan_consolidate(
    src: str,
    dst: str,
    fmt: str,
    settings: Settings | None = None,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 << 30,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    opened: Checkpoint | None = None,
    round_shifted: bool = False,
) -> Job:
    """One full checkpoint from ``src`` in the registered target format ``fmt`` (``hf``,
    ``megatron`` TP1 PP1, ``torch``, ``deepspeed-universal``, ...); ``opened``: ``src``
    opened already (``merge-lora`` opens a checkpoint that holds its adapter);
    ``round_shifted``: ``TargetRequest.round_shifted``."""
    settings = settings or Settings()
    target = registry.target(fmt, CONSOLIDATE)
    refuse_unwritable_dtype(dtype, target)
    refuse_overlap("destination", dst, {"source": src})
    ckpt = opened or open_checkpoint(
        src, settings, iteration=iteration, true_vocab_size=true_vocab_size
    )
    if target.moves_optimizer_state:
        refuse_dp_reshardable(ckpt)
    read, planner = target.planner_for(ckpt)
    request = TargetRequest(
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        style=megatron_style(ckpt),
        round_shifted=round_shifted,
    )
    plan = consolidation(
        read.view,
        planner,
        request,
        source_url=src,
        source_fingerprint=fingerprint(ckpt.storage, read.view),
        target_url=dst,
    )
    if round_shifted and not any(w.shift_rounds for f in plan.files for w in f.tensors):
        refuse_needless_rounding(ckpt, fmt)
    ratio = ckpt.storage.stored_ratio() if isinstance(ckpt.storage, CompressedStorage) else None
    plan = _timed(with_identities(plan, ckpt.storage, read.view), settings, ratio)
    return Job(plan, Sources(read), settings)


def _timed(plan: Plan, settings: Settings, compressed_ratio: float | None = None) -> Plan:
    """The plan with the cost model's time: source reads and target writes, each at its
    storage's calibrated (or built-in) profile; a compressed source fetches fewer bytes and
    spends CPU decoding them."""
    measured = saved_profiles()
    source, target = profile_for(plan.source_url, measured), profile_for(plan.target_url, measured)
    if compressed_ratio is not None:
        source = through_decoder(source, compressed_ratio)
    window = pipeline_window(settings, plan.target_url)
    timed = with_time(plan.estimates, source, target, plan.source_url, plan.target_url, window)
    return plan.model_copy(update={"estimates": timed})


def pipeline_window(settings: Settings, target_url: str | None) -> int:
    """Bytes the executor holds between reading and writing when a process's reads end, for
    each file written at once: to an object store a multipart part being filled; to a local
    disk the dirty pages it lets build up before asking the kernel to write them back
    (``WRITEBACK_STEP``), which the final flush waits for (``planners.cost``)."""
    if target_url is None:
        return 0
    local = is_local(target_url)
    at_once = settings.files_at_once or default_files_at_once(local)
    return at_once * (WRITEBACK_STEP if local else settings.storage.part_size)


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
    (tp, pp), or under expert parallelism expert-DP rank 0 of each (tp, pp, ep), writes its
    files), or with every rank of these nodes."""
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
    out: set[str] = set()
    for g in ranks:
        # The rank's own file, if it writes one (expert-DP rank 0; Megatron's rank order).
        c = coords(layout, g)
        if c.expert_dp == 0:
            out.update(
                f.path for f in ckpt.view.files if f.rank == (c.tp, c.pp) and f.ep_rank == c.ep
            )
    return frozenset(out)


def _stored(ckpt: Checkpoint, url: str, lost: frozenset[str] = frozenset()) -> Stored:
    lost = lost | ckpt.lost
    return Stored(
        view=ckpt.view,
        url=url,
        fingerprint=fingerprint(ckpt.storage, ckpt.view, lost),
        file_sizes=file_sizes(ckpt.storage, ckpt.view, lost),
        lost=lost,
    )


def plan_reshard(
    src: str,
    dst: str | None,
    target: dict[str, Any],
    settings: Settings | None = None,
    *,
    full: list[str] | None = None,
    replicas: list[str] | None = None,
    lost_ranks: str | None = None,
    lost_nodes: str | None = None,
    ranks_per_node: int | None = None,
    strategy: str = "auto",
    dtype: str | None = None,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    target_format: str | None = None,
    measured: dict | None = None,
    optim_sharding: str | None = None,
    shard_group: int | None = None,
) -> Job:
    """Probe the source and every other stored copy, then let the strategy planner choose how
    to reach the ``target`` layout (``tp``, ``pp``, ...; a missing or ``None`` value keeps the
    source's, as ``target_format`` does for a Megatron source: ``planners.target``). ``dst``
    may be ``None`` when only the plan is wanted."""
    settings = settings or Settings()
    if dst is not None:
        refuse_overlap("destination", dst, given_sources(src, full, replicas))
    others = [*(full or []), *(replicas or [])]

    ckpt, extra = open_sources(
        src, others, settings, bool(others), iteration=iteration, true_vocab_size=true_vocab_size
    )
    refuse_dp_reshardable(ckpt)
    if settings.allow_rounding:
        refuse_needless_rounding(ckpt, target_format or "megatron")
    reshardable = {t.name for t in registry.targets(RESHARD)}
    if target_format is None:  # the source's format where it holds layouts, else Megatron's
        kept = ckpt.view.format in reshardable
        target_format = str(ckpt.view.format) if kept else DEFAULT_RESHARD_FORMAT
    writes = registry.target(target_format, RESHARD)
    ckpt, _ = writes.planner_for(ckpt)  # the view this target is cut from
    choice = choose_target(ckpt.view.layout, ckpt.view.spec, target)
    layout = choice.layout
    style = megatron_style(ckpt)
    if optim_sharding is not None and style.optimizer is not None:
        buckets = optim_sharding == "dp_reshardable"
        model_space = optim_sharding == "fully_sharded_model_space"
        optimizer = replace(style.optimizer, buckets=buckets, model_space=model_space)
        style = replace(style, optimizer=optimizer)
    refuse_unwritable_dtype(dtype, writes)
    refuse_unmeshed(shard_group, writes)
    lost = lost_files(ckpt, parse_ranks(lost_ranks), parse_ranks(lost_nodes), ranks_per_node)
    primary = _stored(ckpt, src, lost)
    copies = [_stored(c, u) for c, u in zip(extra, others, strict=True)]
    if ckpt.view.format in reshardable and ckpt.view.layout.is_sharded:
        sharded: Stored | None = primary
    else:  # a full source is cut, never copied as if it were the target
        sharded, copies = None, [primary, *copies]
    plan = plan_auto(
        sharded,
        copies,
        layout,
        target_url=dst,
        target=writes,
        request=TargetRequest(dtype=dtype, style=style, shard_group=shard_group),
        strategy=strategy,
        measured=measured if measured is not None else saved_profiles(),
        window=pipeline_window(settings, dst),
    )
    # The planner names further copies "@<i>/" in the order it was given them.
    given = extra if sharded is not None else [ckpt, *extra]
    by_prefix = {ref.prefix: given[int(ref.prefix[1:-1])] for ref in plan.extra_sources}
    everything = [ckpt, *extra]
    lead = next(c for c, u in zip(everything, [src, *others], strict=True) if u == plan.source_url)
    lead_lost = (lost if lead is ckpt else frozenset()) | _planned_lost(plan, lead)
    plan = with_identities(plan, lead.storage, lead.view, lead_lost)
    if optim_sharding is not None and optimizer_form(plan) is None:
        raise UsageError(
            f"--optim-sharding {optim_sharding}: only a torch_dist target with the distributed "
            "optimizer and optimizer state keeps it (--format torch_dist --distributed-optimizer)"
        )
    notes = (*choice.notes, *plan.notes, *form_change_notes(ckpt.view, plan))
    if notes != plan.notes:
        plan = plan.model_copy(update={"notes": notes})
    return Job(plan, Sources(lead, by_prefix), settings)


def nothing_to_change(
    job: Job, *, strategy: str = "auto", dtype: str | None = None, sharding: str | None = None
) -> bool:
    """Whether a reshard would write its source again as it is: the same format and layout,
    no dtype asked for, nothing lost or read from another copy, and no strategy named (a
    ``direct`` copy asked for by name is still made)."""
    plan = job.plan
    lost: frozenset[str] = job.sources.primary.lost
    return (
        strategy == "auto"
        and dtype is None
        and plan.source_format == plan.target_format
        and plan.source_layout == plan.target_layout
        and not plan.extra_sources
        and not lost
        and not set(f.path for f in job.sources.primary.view.files) - set(plan.source_files)
        and sharding in (None, source_form(job.sources.primary.view))
        and {f.mesh for f in job.sources.primary.view.files} >= {f.mesh for f in plan.files}
    )


def load_plan(path: Path) -> Plan:
    try:
        return Plan.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--plan {path}: no such file") from None
    except ValueError as err:
        first = str(err).splitlines()[0]
        raise UsageError(f"--plan {path}: not a ckptctl plan ({first})") from None


def saved_job(
    plan_file: Path,
    operation: str,
    src: str,
    dst: str,
    settings: Settings | None = None,
    *,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
) -> Job:
    """A saved plan for exactly this source and destination, if the source is unchanged."""
    settings = settings or Settings()
    plan = load_plan(plan_file)
    if plan.operation != operation:
        raise UsageError(f"--plan {plan_file} is a {plan.operation} plan, not a {operation} one")
    if plan.target_url == "" and plan.source_url == src:
        # Made without a destination (``ckptctl plan SRC``): it runs into the one given now.
        plan = plan.model_copy(update={"target_url": dst})
    elif plan.target_url == plan.source_url and not plan.files:
        raise UsageError(
            f"--plan {plan_file} was made without a destination and moves nothing (the shards "
            "already have the target layout)",
            hint="make a plan with a destination: ckptctl plan SRC DST ... --out",
        )
    if (plan.source_url, plan.target_url) != (src, dst):
        raise UsageError(
            f"--plan {plan_file} was made for {plan.source_url} -> {plan.target_url}, "
            f"not {src} -> {dst}"
        )
    urls = [r.url for r in plan.extra_sources]
    ckpt, opened = open_sources(
        src, urls, settings, True, iteration=iteration, true_vocab_size=true_vocab_size
    )
    extra = {r.prefix: e for r, e in zip(plan.extra_sources, opened, strict=True)}
    ckpt, _ = registry.target(plan.target_format, operation).planner_for(ckpt)  # as planned
    check_fresh(plan, ckpt, extra)
    return Job(plan, Sources(ckpt, extra), settings)


def check_fresh(plan: Plan, ckpt: Checkpoint, extra: dict[str, Checkpoint]) -> None:
    """Refuse a saved plan whose source changed since it was made, naming what changed."""
    lost: frozenset[str] = ckpt.lost
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
            raise CheckpointError(
                f"{ref.url} changed since the plan was made", hint="make a new plan"
            )


def _planned_lost(plan: Plan, ckpt: Checkpoint) -> frozenset[str]:
    """Source files the plan treats as lost: those it neither reads nor copies."""
    used = set(plan.source_files)
    return frozenset(f.path for f in ckpt.view.files if f.path not in used)


def run(
    job: Job,
    destination: Destination | None = None,
    progress: Progress | None = None,
    group: Group | None = None,
    starting: Callable[[], object] | None = None,
) -> Report:
    """Write ``job.plan``'s output: check the destination (unless already checked), clear what
    may be cleared, and execute. Whatever fails, nothing is marked complete."""
    plan, settings = job.plan, job.settings
    row, widest = smallest_band(plan)
    if settings.memory_budget < row:
        raise UsageError(
            f"--memory-budget {settings.memory_budget} bytes is less than one row of {widest} "
            f"({row} bytes), the least a job holds at once; give at least that (e.g. 512MiB)"
        )
    destination = destination or check_destination(plan, settings)
    if destination.complete:
        return Report(files_written=[])
    lead = group is None or group.rank == 0
    try:
        with hold(destination.storage) if lead else contextlib.nullcontext():
            if lead and completed_by(destination.storage, plan.fingerprint()):
                return Report(files_written=[])  # another job finished it meanwhile
            if destination.clear_first:
                destination.storage.clear(keep=LOCK)
            if starting is not None:  # the destination is this job's now: say what it does
                starting()
            return _execute(job, destination, progress, group)
    except CkptctlError:
        raise
    except Exception as err:
        storage = classify(err, f"{plan.source_url} -> {plan.target_url}")
        if storage is None:
            raise
        raise storage from err


def _execute(
    job: Job, destination: Destination, progress: Progress | None, group: Group | None
) -> Report:
    from ckptctl.pipeline.execute import execute  # imports torch: only jobs that run need it

    plan, settings = job.plan, job.settings
    target = destination.storage
    if settings.stage_dir is not None:
        target = StagedStorage(target, settings.stage_dir)
    local = job.sources.primary.storage.is_local
    reads = settings.read_parallel or default_read_parallel(local)
    workers = max(plan.read_workers, reads)
    at_once = settings.files_at_once or default_files_at_once(target.is_local)
    if not target.is_local and at_once > 2:
        # The parts in flight (and in memory) of two files, however many files are written.
        target.upload_parallel = max(2, 2 * target.config.upload_parallel // at_once)
    try:
        return execute(
            plan,
            job.sources,
            target,
            progress,
            settings.memory_budget,
            workers=workers,
            checksum=settings.checksum,
            group=group,
            files_at_once=at_once,
        )
    finally:
        if isinstance(target, StagedStorage):
            target.close()
