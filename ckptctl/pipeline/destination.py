"""Where a job writes: checked before anything is written, then prepared.

Checks, in order: the destination (and a staging directory) must not overlap any source; a
finished output of the same plan means nothing to do; an interrupted run of the same plan is
resumed; anything else there is replaced only with ``overwrite`` and only if ckptctl wrote all
of it; a local destination must have room for what the plan writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.checksums.manifest import INCOMPLETE, LOCK, completed_by, foreign_files, read_marker
from ckptctl.errors import OutputExistsError
from ckptctl.io.locations import refuse_overlap
from ckptctl.io.storage import Storage
from ckptctl.io.storage_errors import check_free_space
from ckptctl.model.plan import Plan
from ckptctl.pipeline.lease import refuse_if_held
from ckptctl.settings import Settings


@dataclass(frozen=True)
class Destination:
    storage: Storage
    complete: bool = False
    """A finished output of this very plan is there already: nothing to do."""
    clear_first: bool = False
    """A previous ckptctl output (``overwrite``) or debris of a killed run is removed first."""


def plan_sources(plan: Plan) -> dict[str, str | None]:
    """Every stored checkpoint a plan reads, by the label an error message should use."""
    sources: dict[str, str | None] = {"source": plan.source_url}
    for ref in plan.extra_sources:
        sources[f"source copy ({ref.prefix})"] = ref.url
    return sources


def check_destination(plan: Plan, settings: Settings, *, overwrite: bool = False) -> Destination:
    """Validate where ``plan`` writes; writes nothing."""
    refuse_overlap("destination", plan.target_url, plan_sources(plan))
    if settings.stage_dir is not None:
        refuse_overlap("--stage-dir", settings.stage_dir, plan_sources(plan))
    target = Storage(plan.target_url, settings.storage)
    refuse_if_held(target)  # another job is writing it: nothing it holds means anything yet
    fingerprint = plan.fingerprint()
    if not overwrite and completed_by(target, fingerprint):
        return Destination(target, complete=True)
    marker = (read_marker(target) if target.isdir() else None) or {}
    resuming = bool(marker) and marker.get("plan_fingerprint") == fingerprint and not overwrite
    clear = False if resuming else _existing_content(target, overwrite)
    kept = sum(int(e.get("size", 0)) for e in marker.get("done", {}).values()) if resuming else 0
    check_free_space(plan.target_url, plan.estimates.bytes_written - kept)
    return Destination(target, clear_first=clear)


def _existing_content(target: Storage, overwrite: bool) -> bool:
    """Whether what is at ``target`` must be removed first (it is not a run being resumed);
    refuses what may not be."""
    if not target.exists():
        return False
    if not target.isdir():
        raise OutputExistsError(
            f"{target.url} is a file, not a directory", hint="choose a directory as the destination"
        )
    files = target.find_files()
    # Leftovers of a run killed before it wrote anything are not content.
    files = [f for f in files if f != LOCK and not f.startswith(f"{LOCK}.stale.")]
    if set(files) <= {INCOMPLETE, INCOMPLETE + ".partial"}:
        return bool(files)
    if not overwrite:
        raise OutputExistsError(
            f"{target.url} exists and is not empty",
            hint="pass --overwrite to replace a previous ckptctl output, or choose another "
            "destination",
        )
    foreign = foreign_files(target, files)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise OutputExistsError(
            f"--overwrite: {target.url} holds {foreign[0]}{more}, which no ckptctl job wrote; "
            "ckptctl only replaces its own outputs",
            hint="remove those files yourself or choose another destination",
        )
    return True
