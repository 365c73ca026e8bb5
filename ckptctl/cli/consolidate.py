"""``ckptctl consolidate``: merge a sharded checkpoint into one full checkpoint."""

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
    TrueVocab,
    WeightDType,
    command_settings,
    parse_size,
    state,
)
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import carry_out, finish
from ckptctl.jobs import plan_consolidate, saved_job
from ckptctl.model.stored import Format


def consolidate_cmd(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="Sharded checkpoint directory or URL.")],
    dst: Annotated[str, typer.Argument(help="Destination directory or URL.")],
    fmt: Annotated[
        Format,
        typer.Option(
            "--format",
            help="hf: safetensors weights; megatron: TP1 PP1; torch: one state_dict.pt "
            "(DCP sources).",
        ),
    ] = Format.HF,
    dtype: WeightDType = None,
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="Largest HF safetensors file.")
    ] = "5GiB",
    plan_file: PlanFile = None,
    memory_budget: MemoryBudget = "1GiB",
    checksum: Checksum = ChecksumName.xxh3_64,
    stage_dir: StageDir = None,
    dry_run: DryRun = False,
    overwrite: Overwrite = False,
    as_json: Json = False,
    iteration: Iteration = None,
    true_vocab_size: TrueVocab = None,
) -> None:
    """Merge a sharded checkpoint into one full checkpoint, streaming one tensor at a time."""
    out = Output(as_json)
    with boundary(out, state(ctx).debug):
        settings = command_settings(
            ctx,
            memory_budget=parse_size(memory_budget),
            checksum=checksum.value,
            stage_dir=stage_dir,
        )
        if plan_file is not None:
            job = saved_job(
                plan_file,
                "consolidate",
                src,
                dst,
                settings,
                iteration=iteration,
                true_vocab_size=true_vocab_size,
            )
        else:
            job = plan_consolidate(
                src,
                dst,
                fmt,
                settings,
                dtype=WEIGHT_DTYPES[dtype] if dtype else None,
                max_shard_bytes=parse_size(max_shard_size),
                iteration=iteration,
                true_vocab_size=true_vocab_size,
            )
        report = carry_out(out, job, overwrite=overwrite, dry_run=dry_run)
        finish(out, job.plan, report, as_json)
