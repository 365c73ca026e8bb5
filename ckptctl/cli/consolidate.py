"""``ckptctl consolidate``: merge a sharded checkpoint into one full checkpoint."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.job_options import JobRequest, job_request
from ckptctl.cli.options import (
    WEIGHT_DTYPES,
    Json,
    WeightDType,
    format_option,
    parse_size,
    state,
    with_options,
)
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import carry_out, finish, launch_workers
from ckptctl.formats.target import CONSOLIDATE
from ckptctl.pipeline.jobs import plan_consolidate, saved_job


@with_options(job_request, "job")
def consolidate_cmd(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="Sharded checkpoint directory or URL.")],
    dst: Annotated[str, typer.Argument(help="Destination directory or URL.")],
    job: JobRequest | None = None,
    fmt: Annotated[str, format_option(CONSOLIDATE, "hf")] = "hf",
    dtype: WeightDType = None,
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="Largest HF safetensors file.")
    ] = "5GiB",
    as_json: Json = False,
) -> None:
    """Merge a sharded checkpoint into one full checkpoint, streaming one tensor at a time."""
    assert job is not None
    out = Output(as_json)
    with boundary(out, state(ctx).debug):
        launch_workers(job.workers, job.dry_run)
        settings = job.settings(ctx)
        if job.plan_file is not None:
            planned = saved_job(
                job.plan_file, "consolidate", src, dst, settings, **job.source_options()
            )
        else:
            planned = plan_consolidate(
                src,
                dst,
                fmt,
                settings,
                dtype=WEIGHT_DTYPES[dtype] if dtype else None,
                max_shard_bytes=parse_size(max_shard_size),
                round_shifted=settings.allow_rounding,
                **job.source_options(),
            )
        report = carry_out(out, planned, overwrite=job.overwrite, dry_run=job.dry_run)
        finish(out, planned.plan, report, as_json)
