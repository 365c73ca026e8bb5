"""``ckptctl reshard``: re-split a checkpoint for another TP/PP/VPP/DP layout."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.options import (
    WEIGHT_DTYPES,
    JobRequest,
    Json,
    TargetRequest,
    WeightDType,
    job_request,
    state,
    target_request,
    with_options,
)
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import carry_out, finish, launch_workers
from ckptctl.errors import UsageError
from ckptctl.jobs import given_sources, plan_consolidate, plan_reshard, saved_job
from ckptctl.locations import refuse_overlap
from ckptctl.model.stored import Format


@with_options(target_request, "target")
@with_options(job_request, "job")
def reshard_cmd(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="Checkpoint directory or URL (sharded or full).")],
    dst: Annotated[str, typer.Argument(help="Destination directory or URL.")],
    target: TargetRequest | None = None,
    job: JobRequest | None = None,
    via_full: Annotated[
        str | None,
        typer.Option(
            "--via-full",
            help="Consolidate into this directory first (kept as a topology-free backup), "
            "then cut the target from it.",
        ),
    ] = None,
    dtype: WeightDType = None,
    as_json: Json = False,
) -> None:
    """Re-split a checkpoint for another TP/PP/VPP/DP layout, shard to shard."""
    assert target is not None and job is not None
    out = Output(as_json)
    with boundary(out, state(ctx).debug):
        launch_workers(job.workers, job.dry_run)
        settings = job.settings(ctx)
        sources = given_sources(src, target.full, target.replicas)
        refuse_overlap("destination", dst, sources)
        options = job.source_options()
        if via_full is not None:
            if job.dry_run or job.plan_file is not None:
                raise UsageError("--via-full runs two steps; it takes no --dry-run or --plan")
            refuse_overlap("--via-full directory", via_full, sources)
            refuse_overlap("destination", dst, {"--via-full directory": via_full})
            backup = plan_consolidate(src, via_full, Format.MEGATRON, settings, **options)
            carry_out(out, backup, overwrite=job.overwrite, quiet=as_json)
            src = via_full
        if job.plan_file is not None:
            planned = saved_job(job.plan_file, "reshard", src, dst, settings, **options)
        else:
            planned = plan_reshard(
                src,
                dst,
                target.layout,
                settings,
                dtype=WEIGHT_DTYPES[dtype] if dtype else None,
                **target.plan_options(),
                **options,
            )
        report = carry_out(out, planned, overwrite=job.overwrite, dry_run=job.dry_run)
        finish(out, planned.plan, report, as_json)
