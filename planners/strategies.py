"""The strategies, each a small pure function from the situation to a plan (or a refusal,
``Inapplicable``, saying why it does not apply). ``STRATEGIES`` is the one list that
``plan_auto`` walks; a new strategy is one function and one entry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ckptctl.errors import CheckpointError, UsageError
from ckptctl.model.geometry import nbytes
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import COPY, Estimates, FileWrite, Plan, SourceRef
from ckptctl.model.profile import StorageProfile
from ckptctl.model.stored import CheckpointView
from ckptctl.model.target import TargetPlanner, TargetRequest
from planners.balance import balance_reads
from planners.convert import from_source
from planners.cost import profile_for, shared_overlap, timed
from planners.reshard import plan_reshard


class Inapplicable(UsageError):
    """A strategy that does not apply to what is stored (not an error of the input)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """One checkpoint of the training state, as probed, with what is known to be lost."""

    view: CheckpointView
    url: str
    fingerprint: str
    file_sizes: dict[str, int]
    lost: frozenset[str] = frozenset()
    """Paths (relative to the checkpoint root) that are lost or unreadable."""


@dataclass(frozen=True)
class Situation:
    """Everything a strategy decides from: what is stored and what is wanted."""

    sharded: Stored | None
    """The sharded checkpoint to start from, if there is one."""
    others: dict[str, Stored]
    """Further copies of the same training state (replicas, full checkpoints) by the prefix
    (``@0/``, ``@1/``, ...) their files take in the plan."""
    target_layout: ParallelLayout
    target_url: str | None
    target: TargetPlanner
    request: TargetRequest
    """What the user asked of the target beyond its layout (dtype, the source's style)."""
    measured: dict[str, StorageProfile] = field(default_factory=dict)
    window: int = 0
    """Bytes the executor holds between reading and writing (``planners.cost``)."""


def _prefixed(stored: Stored, prefix: str) -> CheckpointView:
    files = tuple(
        replace(f, path=prefix + f.path) for f in stored.view.files if f.path not in stored.lost
    )
    return replace(stored.view, files=files)


def _timed(
    plan: Plan,
    sources: dict[str, str],
    measured: dict[str, StorageProfile] | None = None,
    concurrent: bool = False,
    window: int = 0,
) -> Plan:
    """Estimate time, charging each source's reads to its own storage profile."""
    bytes_by: dict[str, int] = {}
    requests_by: dict[str, int] = {}
    if len(sources) > 1:  # one source reads what the plan's estimates say
        # (each source file's store found once: plans of the largest models hold 10^5 copies)
        prefixes = [_prefix_of(path, sources) for path in plan.source_files]
        for file in plan.files:
            for tensor in file.tensors:
                for copy in tensor.copies:
                    prefix = prefixes[copy.source]
                    bytes_by[prefix] = bytes_by.get(prefix, 0) + nbytes(copy.sizes, tensor.dtype)
                    requests_by[prefix] = requests_by.get(prefix, 0) + 1
            if file.kind == COPY and file.copy_of is not None:
                prefix = prefixes[file.copy_of]
                requests_by[prefix] = requests_by.get(prefix, 0) + 1
    else:
        for prefix in sources:
            bytes_by[prefix] = plan.estimates.bytes_read
            requests_by[prefix] = plan.estimates.read_requests
    source, target = profile_for(plan.source_url, measured), profile_for(plan.target_url, measured)
    e = plan.estimates
    per_source = [
        profile_for(sources[p], measured).seconds(bytes_by.get(p, 0), requests_by.get(p, 0))
        for p in sources
    ]
    # Copies on different stores are read side by side when the plan spreads reads over them.
    read = max(per_source, default=0.0) if concurrent else sum(per_source)
    if plan.strategy == "direct":
        read = profile_for(plan.source_url, measured).seconds(e.bytes_read, e.read_requests)
    write = target.seconds(e.bytes_written, e.write_requests, write=True)
    overlap = shared_overlap(source, target) if len(sources) == 1 else None
    urls = (plan.source_url, plan.target_url)
    e = timed(e, read, write, source, target, *urls, overlap, window)
    return plan.model_copy(update={"estimates": e})


def _prefix_of(path: str, sources: dict[str, str]) -> str:
    return next((p for p in sorted(sources, key=len, reverse=True) if path.startswith(p)), "")


def _reshard_from(
    s: Situation, base: Stored | None, with_others: bool, name: str, reason: str
) -> Plan:
    """Shard-to-shard conversion from ``base`` (and, if asked, every other copy)."""
    parts = ([("", base)] if base else []) + (list(s.others.items()) if with_others else [])
    lead = parts[0][1]
    views = [_prefixed(stored, prefix) for prefix, stored in parts]
    view = replace(views[0], files=tuple(f for v in views for f in v.files))
    plan = plan_reshard(
        view,
        s.target_layout,
        s.target,
        s.request,
        source_url=lead.url,
        source_fingerprint=lead.fingerprint,
        target_url=s.target_url or "",
    )
    extra = tuple(
        SourceRef(prefix=p, url=o.url, format=o.view.format, fingerprint=o.fingerprint)
        for p, o in s.others.items()
        if with_others
    )
    sources = {"": lead.url} if base else {}
    sources.update({p: o.url for p, o in s.others.items() if with_others})
    plan = plan.model_copy(update={"strategy": name, "reason": reason, "extra_sources": extra})
    return _timed(plan, sources, s.measured, window=s.window)


def direct(s: Situation) -> Plan:
    """The stored shards already have the target layout and are intact."""
    if s.sharded is None:
        raise Inapplicable("no sharded checkpoint is stored")
    if s.target.name != s.sharded.view.format:
        raise Inapplicable(f"the stored format is not {s.target.name}")
    plan = _direct(s.sharded, s.target, s.target_layout, s.target_url)
    return _timed(plan, {"": s.sharded.url}, s.measured, window=s.window)


def shard_to_shard(s: Situation) -> Plan:
    """Every target shard from the overlapping ranges of the stored shards (spread over
    intact replicas by bandwidth when there are some)."""
    sharded = s.sharded
    if sharded is None:
        raise Inapplicable("no sharded checkpoint is stored")
    if sharded.lost:
        raise Inapplicable(f"{len(sharded.lost)} stored file(s) are lost")
    plan = _reshard_from(
        s,
        sharded,
        False,
        "shard-to-shard",
        f"{sharded.view.layout.describe()} -> {s.target_layout.describe()}: each target shard "
        "assembled from the overlapping byte ranges of the stored shards",
    )
    replicas = {
        p: o
        for p, o in s.others.items()
        if not o.lost
        and o.view.layout == sharded.view.layout
        and o.view.format == sharded.view.format
    }
    if not replicas:
        return plan
    balanced = balance_reads(
        plan,
        {p: profile_for(o.url, s.measured) for p, o in replicas.items()},
        profile_for(sharded.url, s.measured),
    )
    refs = tuple(
        SourceRef(prefix=p, url=o.url, format=o.view.format, fingerprint=o.fingerprint)
        for p, o in replicas.items()
    )
    balanced = balanced.model_copy(
        update={
            "extra_sources": refs,
            "read_workers": 1 + len(replicas),
            "reason": plan.reason
            + f"; reads spread over {1 + len(replicas)} stored copies by bandwidth",
        }
    )
    sources = {"": sharded.url, **{p: o.url for p, o in replicas.items()}}
    return _timed(balanced, sources, s.measured, concurrent=True, window=s.window)


def recovery(s: Situation) -> Plan:
    """Lost files read from a replica or a full checkpoint, the rest from the survivors."""
    if s.sharded is None or not s.sharded.lost:
        raise Inapplicable("no stored file is lost")
    if not s.others:
        lost = ", ".join(sorted(s.sharded.lost))
        raise CheckpointError(
            f"lost and stored nowhere else: {lost}; give a replica or a full checkpoint "
            "(--replica / --full) to recover from"
        )
    kinds = sorted(
        {
            "a full checkpoint" if not o.view.layout.is_sharded else "a replica"
            for o in s.others.values()
        }
    )
    return _reshard_from(
        s,
        s.sharded,
        True,
        "recovery",
        f"{len(s.sharded.lost)} lost file(s) read from {' and '.join(kinds)}, the rest from "
        "the surviving shards",
    )


def full_then_split(s: Situation) -> Plan:
    """The target cut from a stored full checkpoint alone."""
    full = next((o for o in s.others.values() if not o.view.layout.is_sharded and not o.lost), None)
    if full is None:
        raise Inapplicable("no full checkpoint is stored (give one with --full)")
    plan = _reshard_from(s, full, False, "full-then-split", "")
    return plan.model_copy(
        update={"reason": f"cut the full checkpoint {full.url} for {s.target_layout.describe()}"}
    )


STRATEGIES: tuple[tuple[str, Callable[[Situation], Plan]], ...] = (
    ("direct", direct),
    ("shard-to-shard", shard_to_shard),
    ("recovery", recovery),
    ("full-then-split", full_then_split),
)
"""Every strategy, in the order ties are broken."""


def _direct(
    sharded: Stored, target: TargetPlanner, target_layout: ParallelLayout, target_url: str | None
) -> Plan:
    view = sharded.view
    finish = target.stored_as_is(view)
    if finish is None:
        raise Inapplicable(f"the stored format {view.format} is not the target's")
    if sharded.lost:
        raise Inapplicable(f"{len(sharded.lost)} stored file(s) are lost")
    if view.layout != target_layout:
        raise Inapplicable(f"the stored layout {view.layout.describe()} is not the target's")
    paths = tuple(f.path for f in view.files)
    nbytes = sum(sharded.file_sizes.get(p, 0) for p in paths)
    moving = bool(target_url)
    files = tuple(FileWrite(path=p, kind=COPY, tensors=(), copy_of=i) for i, p in enumerate(paths))
    return Plan(
        operation="reshard",
        strategy="direct",
        reason=(
            "the stored shards already have the target layout and are intact: "
            + ("copied byte for byte" if moving else "load them directly, no data moves")
        ),
        **from_source(view, sharded.url, sharded.fingerprint),
        target_url=target_url or sharded.url,
        target_format=target.name,
        target_layout=target_layout,
        files=files if moving else (),
        finalize=finish if moving else (),
        estimates=Estimates(
            bytes_read=nbytes if moving else 0,
            bytes_written=nbytes if moving else 0,
            read_requests=len(paths) if moving else 0,
            write_requests=len(paths) if moving else 0,
            peak_memory_bytes=8 << 20 if moving else 0,
        ),
    )
