"""Plan ``reshard``: any Megatron-family layout (or a full checkpoint) into another layout of a
target format that holds layouts (``ckptctl.model.target``).

Shard to shard: each target rank file is filled from exactly the source boxes that overlap it,
so no full model is ever assembled and no intermediate full checkpoint is written. A full source
(HF safetensors, or TP1 PP1 Megatron) is the same computation with one source shard.
"""

from __future__ import annotations

from dataclasses import replace

from ckptctl.errors import UsageError
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import Plan
from ckptctl.model.stored import CheckpointView, unmapped_model
from ckptctl.model.target import TargetPlanner, TargetRequest
from planners.convert import collector_paused, from_source, plan_target


def plan_reshard(
    source: CheckpointView,
    target_layout: ParallelLayout,
    target: TargetPlanner,
    request: TargetRequest,
    *,
    source_url: str,
    source_fingerprint: str,
    target_url: str,
) -> Plan:
    spec = source.spec
    if spec is None and not target.cuts_by_name:
        raise UsageError(unmapped_model(source, "a resharded checkpoint"))
    if spec is not None:
        target_layout.check_against(spec)
    with collector_paused():
        planned = target.target_files(source, replace(request, layout=target_layout))
        files, estimates = plan_target(source, target, planned)
    notes, warnings = [*source.notes, *planned.notes], [*source.warnings, *planned.warnings]
    if not planned.optimizer_carried and source.has_optimizer:
        warnings.append(
            f"the {source.format} source's optimizer state is not carried to "
            f"{target.name} yet: the target holds weights only"
        )
    elif not planned.optimizer_carried:
        notes.append("no optimizer state in the source: the target holds weights only")
    is_full = not source.layout.is_sharded
    return Plan(
        operation="reshard",
        strategy="full-then-split" if is_full else "shard-to-shard",
        reason=(
            f"cut the full checkpoint for {target_layout.describe()}"
            if is_full
            else f"{source.layout.describe()} -> {target_layout.describe()}: each target shard "
            "assembled from the overlapping byte ranges of the source shards"
        ),
        **from_source(source, source_url, source_fingerprint),
        target_url=target_url,
        target_format=target.name,
        target_layout=target_layout,
        files=files,
        finalize=planned.finalize,
        estimates=estimates,
        notes=tuple(notes),
        warnings=tuple(warnings),
    )
