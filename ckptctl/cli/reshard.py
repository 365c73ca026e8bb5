"""``ckptctl reshard``: re-split a checkpoint for another TP/PP/VPP/DP layout."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ckptctl.cli.job_options import JobRequest, job_request
from ckptctl.cli.options import (
    WEIGHT_DTYPES,
    Json,
    TargetRequest,
    WeightDType,
    state,
    target_request,
    with_options,
)
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import carry_out, finish, launch_workers
from ckptctl.errors import UsageError
from ckptctl.formats.torch_dist.optimizer_form import optimizer_form
from ckptctl.io.locations import refuse_overlap
from ckptctl.model.plan import Plan
from ckptctl.pipeline.jobs import (
    given_sources,
    nothing_to_change,
    plan_consolidate,
    plan_reshard,
    saved_job,
)


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
            backup = plan_consolidate(src, via_full, "megatron", settings, **options)
            carry_out(out, backup, overwrite=job.overwrite, quiet=as_json)
            src = via_full
        weights = WEIGHT_DTYPES[dtype] if dtype else None
        if job.plan_file is not None:
            planned = saved_job(job.plan_file, "reshard", src, dst, settings, **options)
            refuse_conflicts(job.plan_file, planned.plan, target, weights)
        else:
            planned = plan_reshard(
                src, dst, target.layout, settings, dtype=weights, **target.plan_options(), **options
            )
            if nothing_to_change(
                planned, strategy=target.strategy, dtype=weights, sharding=target.optim_sharding
            ):
                say_nothing_to_change(out, planned.plan, as_json)
                return
        report = carry_out(out, planned, overwrite=job.overwrite, dry_run=job.dry_run)
        finish(out, planned.plan, report, as_json)


def refuse_conflicts(plan_file: Path, plan: Plan, target: TargetRequest, dtype: str | None) -> None:
    """A saved plan runs as it was made: a target flag given beside ``--plan`` must say what
    the plan says, or the command is refused (the flag would otherwise be ignored)."""
    layout = plan.target_layout
    planned: dict[str, Any] = {
        "--tp": layout.tp,
        "--pp": layout.pp,
        "--vpp": layout.vpp,
        "--dp": layout.dp,
        "--ep": layout.ep,
        "--etp": layout.expert_tp,
        "--pp-first-stage-layers": layout.first_stage_layers,
        "--pp-last-stage-layers": layout.last_stage_layers,
        "--distributed-optimizer": layout.distributed_optimizer,
        "--even-stages": layout.first_stage_layers is None and layout.last_stage_layers is None,
        "--format": plan.target_format,
        "--optim-sharding": optimizer_form(plan),
        "--fsdp-size": next((f.mesh[-1] for f in plan.files if f.mesh), None),
    }
    differ = [
        f"{flag} {value} (the plan: {planned[flag]})"
        for flag, value in target.given().items()
        if value != planned[flag]
    ]
    if dtype is not None:
        differ.append("--dtype (the plan fixes each tensor's dtype)")
    if target.strategy != "auto" and target.strategy != plan.strategy:
        differ.append(f"--strategy {target.strategy} (the plan: {plan.strategy})")
    if differ:
        raise UsageError(
            f"--plan {plan_file} runs the saved plan as it is, but {'; '.join(differ)}",
            hint="drop the flags, or make a new plan with ckptctl plan --out",
        )


def say_nothing_to_change(out: Output, plan: Plan, as_json: bool) -> None:
    what = f"{plan.target_format} {plan.target_layout.describe()}"
    if as_json:
        out.json(
            {
                "operation": plan.operation,
                "source": plan.source_url,
                "target": plan.target_url,
                "nothing_to_change": True,
                "target_format": plan.target_format,
                "target_layout": plan.target_layout.model_dump(mode="json"),
                "files": [],
            }
        )
        return
    out.show(
        f"nothing to change: {plan.source_url} already is {what}, the target; "
        f"{plan.target_url} was not written (give --tp/--pp/--format/... to change it, or "
        "--strategy direct to copy it as it is)"
    )
