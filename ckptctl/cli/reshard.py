"""``ckptctl reshard``: re-split a checkpoint for another TP/PP/VPP/DP layout."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.options import (
    WEIGHT_DTYPES,
    Checksum,
    ChecksumName,
    DryRun,
    Iteration,
    Json,
    MemoryBudget,
    Overwrite,
    PlanFile,
    StageDir,
    TargetRequest,
    TrueVocab,
    WeightDType,
    command_settings,
    parse_size,
    state,
    target_request,
    with_options,
)
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import carry_out, finish
from ckptctl.errors import UsageError
from ckptctl.jobs import given_sources, plan_consolidate, plan_reshard, saved_job
from ckptctl.locations import refuse_overlap
from ckptctl.model.stored import Format


@with_options(target_request, "target")
def reshard_cmd(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="Checkpoint directory or URL (sharded or full).")],
    dst: Annotated[str, typer.Argument(help="Destination directory or URL.")],
    target: TargetRequest | None = None,
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
    dry_run: DryRun = False,
    overwrite: Overwrite = False,
    as_json: Json = False,
    iteration: Iteration = None,
    true_vocab_size: TrueVocab = None,
) -> None:
    """Re-split a checkpoint for another TP/PP/VPP/DP layout, shard to shard."""
    out = Output(as_json)
    with boundary(out, state(ctx).debug):
        settings = command_settings(
            ctx,
            memory_budget=parse_size(memory_budget),
            checksum=checksum.value,
            stage_dir=stage_dir,
        )
        assert target is not None
        sources = given_sources(src, target.full, target.replicas)
        refuse_overlap("destination", dst, sources)
        options = {"iteration": iteration, "true_vocab_size": true_vocab_size}
        if via_full is not None:
            if dry_run or plan_file is not None:
                raise UsageError("--via-full runs two steps; it takes no --dry-run or --plan")
            refuse_overlap("--via-full directory", via_full, sources)
            refuse_overlap("destination", dst, {"--via-full directory": via_full})
            backup = plan_consolidate(src, via_full, Format.MEGATRON, settings, **options)
            carry_out(out, backup, overwrite=overwrite, quiet=as_json)
            src = via_full
        if plan_file is not None:
            job = saved_job(plan_file, "reshard", src, dst, settings, **options)
        else:
            job = plan_reshard(
                src,
                dst,
                target.layout,
                settings,
                dtype=WEIGHT_DTYPES[dtype] if dtype else None,
                **target.plan_options(),
                **options,
            )
        report = carry_out(out, job, overwrite=overwrite, dry_run=dry_run)
        finish(out, job.plan, report, as_json)
