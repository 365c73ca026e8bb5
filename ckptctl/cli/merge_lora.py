"""``ckptctl merge-lora``: merge a PEFT LoRA adapter into a base checkpoint, written as HF
safetensors in the base's dtype."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.job_options import JobRequest, job_request
from ckptctl.cli.options import Json, parse_size, state, with_options
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import carry_out, finish, launch_workers
from ckptctl.errors import UsageError
from ckptctl.io.locations import refuse_overlap
from ckptctl.pipeline.jobs import plan_consolidate


@with_options(job_request, "job")
def merge_lora_cmd(
    ctx: typer.Context,
    base: Annotated[str, typer.Argument(help="Base checkpoint (any format ckptctl reads).")],
    adapter: Annotated[
        str, typer.Argument(help="PEFT adapter directory (adapter_config.json + safetensors).")
    ],
    dst: Annotated[str, typer.Argument(help="Destination directory or URL (HF safetensors).")],
    job: JobRequest | None = None,
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="Largest HF safetensors file.")
    ] = "5GiB",
    as_json: Json = False,
) -> None:
    """Merge a LoRA adapter into its base model: W + scaling * B @ A in float32, rounded once
    to the base's dtype, streamed a band of rows at a time."""
    from ckptctl.lora.adapter import open_adapter  # torch and numpy: only when merging
    from ckptctl.lora.merge import LoraMerge
    from ckptctl.lora.plan import with_adapter

    assert job is not None
    out = Output(as_json)
    with boundary(out, state(ctx).debug):
        launch_workers(job.workers, job.dry_run)
        if job.plan_file is not None:
            raise UsageError("--plan: merge-lora plans its job from the adapter each time")
        settings = job.settings(ctx)
        refuse_overlap("destination", dst, {"adapter": adapter})
        lora = open_adapter(adapter, settings.storage, settings.trusted_fields)
        planned = plan_consolidate(
            base,
            dst,
            "hf",
            settings,
            max_shard_bytes=parse_size(max_shard_size),
            **job.source_options(),
        )
        planned.plan = with_adapter(planned.plan, lora)
        planned.sources.adjust = LoraMerge(lora)
        report = carry_out(out, planned, overwrite=job.overwrite, dry_run=job.dry_run)
        finish(out, planned.plan, report, as_json)
