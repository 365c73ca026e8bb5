"""Choose how to reach a target layout from what is stored, and say why.

Strategies, each valid only in some situations:

* ``direct``: the stored sharded checkpoint already has the target layout and every file is
  intact: its shards load as they are (copied byte for byte if a destination is given).
* ``shard-to-shard``: every target shard assembled from the overlapping ranges of the stored
  shards.
* ``recovery``: some stored files are lost; what they held is read from a replica or a full
  checkpoint of the same training state, the rest from the surviving shards.
* ``full-then-split``: the target cut from a stored full checkpoint alone.

``auto`` takes the valid strategy the cost model finds fastest; the others stay in the plan as
alternatives with their estimates, or with the reason they could not be used. Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ckptctl.errors import CheckpointError, CkptctlError, UsageError
from ckptctl.formats.megatron.layout import TRACKER, MegatronStyle, tracker_text
from ckptctl.model.geometry import nbytes
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import (
    Alternative,
    Estimates,
    FileKind,
    FileWrite,
    Plan,
    SourceRef,
    TextWrite,
)
from ckptctl.model.profile import StorageProfile
from ckptctl.model.stored import CheckpointView, Format
from planners.balance import balance_reads
from planners.cost import profile_for, with_time
from planners.graph import execution_order
from planners.reshard import plan_reshard


class Inapplicable(UsageError):
    """A strategy that does not apply to what is stored (not an error of the input)."""


STRATEGIES = ("direct", "shard-to-shard", "recovery", "full-then-split")


@dataclass(frozen=True, slots=True)
class Stored:
    """One checkpoint of the training state, as probed, with what is known to be lost."""

    view: CheckpointView
    url: str
    fingerprint: str
    file_sizes: dict[str, int]
    lost: frozenset[str] = frozenset()
    """Paths (relative to the checkpoint root) that are lost or unreadable."""


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
) -> Plan:
    """Estimate time, charging each source's reads to its own storage profile."""
    bytes_by: dict[str, int] = {}
    requests_by: dict[str, int] = {}
    for file in plan.files:
        for tensor in file.tensors:
            for copy in tensor.copies:
                prefix = _prefix_of(plan.source_files[copy.source], sources)
                bytes_by[prefix] = bytes_by.get(prefix, 0) + nbytes(copy.sizes, tensor.dtype)
                requests_by[prefix] = requests_by.get(prefix, 0) + 1
        if file.kind is FileKind.COPY and file.copy_of is not None:
            prefix = _prefix_of(plan.source_files[file.copy_of], sources)
            requests_by[prefix] = requests_by.get(prefix, 0) + 1
    target = profile_for(plan.target_url, measured)
    e = with_time(plan.estimates, profile_for(plan.source_url, measured), target)
    per_source = [
        profile_for(sources[p], measured).seconds(bytes_by.get(p, 0), requests_by.get(p, 0))
        for p in sources
    ]
    # Copies on different stores are read side by side when the plan spreads reads over them.
    read = max(per_source, default=0.0) if concurrent else sum(per_source)
    if plan.strategy == "direct":
        read = profile_for(plan.source_url, measured).seconds(e.bytes_read, e.read_requests)
    write = target.seconds(e.bytes_written, e.write_requests, write=True)
    return plan.model_copy(update={"estimates": e.model_copy(update={"seconds": read + write})})


def _prefix_of(path: str, sources: dict[str, str]) -> str:
    return next((p for p in sorted(sources, key=len, reverse=True) if path.startswith(p)), "")


def _direct(sharded: Stored, target_layout: ParallelLayout, target_url: str | None) -> Plan:
    view = sharded.view
    if view.format is not Format.MEGATRON:
        raise Inapplicable(f"the stored format {view.format.value} is not the target's")
    if sharded.lost:
        raise Inapplicable(f"{len(sharded.lost)} stored file(s) are lost")
    if view.layout != target_layout:
        raise Inapplicable(f"the stored layout {view.layout.describe()} is not the target's")
    paths = tuple(f.path for f in view.files)
    nbytes = sum(sharded.file_sizes.get(p, 0) for p in paths)
    moving = bool(target_url)
    files = tuple(
        FileWrite(path=p, kind=FileKind.COPY, tensors=(), copy_of=i) for i, p in enumerate(paths)
    )
    return Plan(
        operation="reshard",
        strategy="direct",
        reason=(
            "the stored shards already have the target layout and are intact: "
            + ("copied byte for byte" if moving else "load them directly, no data moves")
        ),
        source_url=sharded.url,
        source_format=view.format,
        source_fingerprint=sharded.fingerprint,
        source_files=paths,
        spec=view.spec,
        source_layout=view.layout,
        target_url=target_url or sharded.url,
        target_format=view.format,
        target_layout=target_layout,
        iteration=view.iteration,
        files=files if moving else (),
        finalize=(TextWrite(path=TRACKER, content=tracker_text(view.iteration)),) if moving else (),
        estimates=Estimates(
            bytes_read=nbytes if moving else 0,
            bytes_written=nbytes if moving else 0,
            read_requests=len(paths) if moving else 0,
            write_requests=len(paths) if moving else 0,
            peak_memory_bytes=8 << 20 if moving else 0,
        ),
    )


def plan_auto(
    sharded: Stored | None,
    others: list[Stored],
    target_layout: ParallelLayout,
    *,
    target_url: str | None,
    style: MegatronStyle,
    strategy: str = "auto",
    dtype: str | None = None,
    measured: dict[str, StorageProfile] | None = None,
    target_format: Format = Format.MEGATRON,
) -> Plan:
    """The plan of the chosen strategy, with every strategy weighed as an alternative.

    ``measured`` maps URL prefixes to calibrated storage profiles."""
    if strategy != "auto" and strategy not in STRATEGIES:
        raise UsageError(f"--strategy {strategy}: choose auto or one of {', '.join(STRATEGIES)}")
    if sharded is None and not others:
        raise UsageError("nothing stored to plan from")
    prefixes = {f"@{i}/": o for i, o in enumerate(others)}
    url_of = {p: o.url for p, o in prefixes.items()}
    out_url = target_url or ""

    def combined(base: Stored | None, with_others: bool) -> tuple[CheckpointView, Stored]:
        parts = ([("", base)] if base else []) + (list(prefixes.items()) if with_others else [])
        lead = parts[0][1]
        views = [_prefixed(s, p) for p, s in parts]
        files = tuple(f for v in views for f in v.files)
        return replace(views[0], files=files), lead

    def reshard_from(base: Stored | None, with_others: bool, name: str, reason: str) -> Plan:
        view, lead = combined(base, with_others)
        plan = plan_reshard(
            view,
            target_layout,
            source_url=lead.url,
            source_fingerprint=lead.fingerprint,
            target_url=out_url,
            style=style,
            dtype=dtype,
            target_format=target_format,
        )
        extra = tuple(
            SourceRef(prefix=p, url=o.url, format=o.view.format, fingerprint=o.fingerprint)
            for p, o in prefixes.items()
            if with_others
        )
        sources = {"": lead.url} if base else {}
        sources.update({p: url_of[p] for p in prefixes if with_others})
        plan = plan.model_copy(update={"strategy": name, "reason": reason, "extra_sources": extra})
        return _timed(plan, sources, measured)

    def full_then_split() -> Plan:
        full = next((o for o in others if not o.view.layout.is_sharded and not o.lost), None)
        if full is None:
            raise Inapplicable("no full checkpoint is stored (give one with --full)")
        plan = reshard_from(full, False, "full-then-split", "")
        return plan.model_copy(
            update={"reason": f"cut the full checkpoint {full.url} for {target_layout.describe()}"}
        )

    def recovery() -> Plan:
        if sharded is None or not sharded.lost:
            raise Inapplicable("no stored file is lost")
        if not others:
            lost = ", ".join(sorted(sharded.lost))
            raise CheckpointError(
                f"lost and stored nowhere else: {lost}; give a replica or a full checkpoint "
                "(--replica / --full) to recover from"
            )
        kinds = sorted(
            {"a full checkpoint" if not o.view.layout.is_sharded else "a replica" for o in others}
        )
        return reshard_from(
            sharded,
            True,
            "recovery",
            f"{len(sharded.lost)} lost file(s) read from {' and '.join(kinds)}, the rest from "
            "the surviving shards",
        )

    def shard_to_shard() -> Plan:
        if sharded is None:
            raise Inapplicable("no sharded checkpoint is stored")
        if sharded.lost:
            raise Inapplicable(f"{len(sharded.lost)} stored file(s) are lost")
        plan = reshard_from(
            sharded,
            False,
            "shard-to-shard",
            f"{sharded.view.layout.describe()} -> {target_layout.describe()}: each target shard "
            "assembled from the overlapping byte ranges of the stored shards",
        )
        replicas = {
            p: o
            for p, o in prefixes.items()
            if not o.lost
            and o.view.layout == sharded.view.layout
            and o.view.format == sharded.view.format
        }
        if not replicas:
            return plan
        balanced = balance_reads(
            plan,
            {p: profile_for(o.url, measured) for p, o in replicas.items()},
            profile_for(sharded.url, measured),
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
        return _timed(balanced, sources, measured, concurrent=True)

    def direct() -> Plan:
        if sharded is None:
            raise Inapplicable("no sharded checkpoint is stored")
        if target_format is not sharded.view.format:
            raise Inapplicable(f"the stored format is not {target_format.value}")
        return _timed(_direct(sharded, target_layout, target_url), {"": sharded.url}, measured)

    builders: dict[str, Callable[[], Plan]] = {
        "direct": direct,
        "shard-to-shard": shard_to_shard,
        "recovery": recovery,
        "full-then-split": full_then_split,
    }
    results: dict[str, Plan] = {}
    errors: dict[str, CkptctlError] = {}
    for name in STRATEGIES:
        try:
            results[name] = builders[name]()
        except CkptctlError as err:
            errors[name] = err
    refusals = {name: str(err) for name, err in errors.items()}
    if strategy != "auto":
        if strategy not in results:
            err = errors[strategy]
            raise type(err)(f"--strategy {strategy} cannot be used: {err}")
        chosen = strategy
    elif results:
        chosen = min(results, key=lambda n: (results[n].estimates.seconds, STRATEGIES.index(n)))
    else:
        # The first strategy that applied but failed says what is really wrong.
        raise next(
            (e for e in errors.values() if not isinstance(e, Inapplicable)),
            CheckpointError("no strategy can produce the target"),
        )
    alternatives = tuple(
        Alternative(strategy=n, estimates=results[n].estimates)
        if n in results
        else Alternative(strategy=n, refused=refusals[n])
        for n in STRATEGIES
        if n != chosen
    )
    return execution_order(results[chosen]).model_copy(update={"alternatives": alternatives})
