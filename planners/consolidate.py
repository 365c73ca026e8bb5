"""Plan ``consolidate``: a sharded checkpoint into one full, topology-free checkpoint of the
target format (``ckptctl.model.target``), every tensor filled from the source pieces that
overlap it."""

from __future__ import annotations

from ckptctl.model.plan import Plan
from ckptctl.model.stored import CheckpointView
from ckptctl.model.target import TargetPlanner, TargetRequest
from planners.convert import collector_paused, from_source, plan_target


def plan_consolidate(
    source: CheckpointView,
    target: TargetPlanner,
    request: TargetRequest,
    *,
    source_url: str,
    source_fingerprint: str,
    target_url: str,
) -> Plan:
    """One full checkpoint in ``target``'s format (``request.layout`` is ``None``: the format
    decides; ``request.dtype`` converts weights only, optimizer state stays fp32)."""
    with collector_paused():
        planned = target.target_files(source, request)
        files, estimates = plan_target(source, target, planned)
    return Plan(
        operation="consolidate",
        strategy="merge",
        reason=planned.reason,
        **from_source(source, source_url, source_fingerprint),
        target_url=target_url,
        target_format=target.name,
        target_layout=planned.layout,
        files=files,
        finalize=planned.finalize,
        estimates=estimates,
        notes=(*source.notes, *planned.notes),
        warnings=(*source.warnings, *planned.warnings),
    )
