"""``ckptctl reshard``: re-split a checkpoint for another TP/PP/VPP/DP layout."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.options import (
    WEIGHT_DTYPES,
    Checksum,
    ChecksumName,
    DistOpt,
    Dp,
    DryRun,
    FirstStage,
    Full,
    Iteration,
    Json,
    LastStage,
    LostNodes,
    LostRanks,
    MemoryBudget,
    Overwrite,
    PlanFile,
    Pp,
    RanksPerNode,
    Replica,
    ReshardFormat,
    StageDir,
    Strategy,
    StrategyName,
    Tp,
    TrueVocab,
    Vpp,
    WeightDType,
    command_settings,
    layout_choices,
    parse_size,
    state,
)
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import carry_out, finish
from ckptctl.errors import UsageError
from ckptctl.jobs import given_sources, plan_consolidate, plan_reshard, saved_job
from ckptctl.locations import refuse_overlap
from ckptctl.model.stored import Format


def reshard_cmd(
    ctx: typer.Context,
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
    out = Output(as_json)
    with boundary(out, state(ctx).debug):
        settings = command_settings(
            ctx,
            memory_budget=parse_size(memory_budget),
            checksum=checksum.value,
            stage_dir=stage_dir,
        )
        sources = given_sources(src, full, replica)
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
                layout_choices(tp, pp, vpp, dp, first, last, distributed_optimizer),
                settings,
                full=full,
                replicas=replica,
                lost_ranks=lost_ranks,
                lost_nodes=lost_nodes,
                ranks_per_node=ranks_per_node,
                strategy=strategy.value,
                dtype=WEIGHT_DTYPES[dtype] if dtype else None,
                target_format=target_format,
                **options,
            )
        report = carry_out(out, job, overwrite=overwrite, dry_run=dry_run)
        finish(out, job.plan, report, as_json)
