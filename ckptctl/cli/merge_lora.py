"""``ckptctl merge-lora``: merge a PEFT LoRA adapter into a base checkpoint, written as HF
safetensors in the base's dtype; or, for a checkpoint trained with its adapter in it (verl's
LoRA actor), merge that one, or write it out as a PEFT adapter directory (``--adapter-only``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.job_options import JobRequest, job_request
from ckptctl.cli.options import Json, parse_size, state, with_options
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.running import carry_out, finish, launch_workers
from ckptctl.errors import OutputExistsError, UsageError
from ckptctl.io.locations import refuse_overlap
from ckptctl.pipeline.jobs import plan_consolidate

if TYPE_CHECKING:
    from ckptctl.formats.base import Checkpoint
    from ckptctl.lora.adapter import HeldAdapter, LoraSource
    from ckptctl.settings import Settings


@with_options(job_request, "job")
def merge_lora_cmd(
    ctx: typer.Context,
    base: Annotated[
        str,
        typer.Argument(
            help="Base checkpoint (any format ckptctl reads), or a checkpoint trained with "
            "its LoRA adapter in it (then give no ADAPTER)."
        ),
    ],
    adapter: Annotated[
        str,
        typer.Argument(
            help="PEFT adapter directory (adapter_config.json + safetensors), or verl's "
            "Megatron actor directory with adapter_checkpoint/ (Megatron-Bridge's LoRA); DST "
            "when BASE holds its adapter."
        ),
    ],
    dst: Annotated[
        str | None,
        typer.Argument(help="Destination directory or URL (HF safetensors)."),
    ] = None,
    lora_alpha: Annotated[
        float | None,
        typer.Option(
            "--lora-alpha",
            help="The alpha an adapter trained inside a checkpoint, or verl's Megatron adapter, "
            "was trained with, where the run did not record it (verl 0.9 records it for FSDP "
            "actors in lora_train_meta.json; before: actor_rollout_ref.model.lora_alpha; "
            "Megatron: actor_rollout_ref.model.lora.alpha).",
        ),
    ] = None,
    adapter_only: Annotated[
        bool,
        typer.Option(
            "--adapter-only",
            help="Write only the adapter (trained inside BASE, or verl's Megatron adapter "
            "of BASE's model), as a PEFT adapter directory.",
        ),
    ] = False,
    job: JobRequest | None = None,
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="Largest HF safetensors file.")
    ] = "5GiB",
    as_json: Json = False,
) -> None:
    """Merge a LoRA adapter into its base model: W + scaling * B @ A in float32, rounded once
    to the base's dtype, streamed a band of rows at a time. BASE ADAPTER DST merges an adapter
    directory; BASE DST merges the adapter BASE was trained with (or, with --adapter-only,
    exports it)."""
    assert job is not None
    out = Output(as_json)
    with boundary(out, state(ctx).debug):
        launch_workers(job.workers, job.dry_run)
        if job.plan_file is not None:
            raise UsageError("--plan: merge-lora plans its job from the adapter each time")
        settings = job.settings(ctx)
        if dst is None:
            _inside(out, base, adapter, settings, job, lora_alpha, adapter_only, max_shard_size)
            return
        from ckptctl.lora.megatron import holds_megatron_adapter

        if holds_megatron_adapter(adapter, settings.storage):
            _megatron(
                out, base, adapter, dst, settings, job, lora_alpha, adapter_only, max_shard_size
            )
            return
        if not _peft_directory(adapter, settings):
            _held(out, base, adapter, dst, settings, job, lora_alpha, adapter_only, max_shard_size)
            return
        if lora_alpha is not None or adapter_only:
            flag = "--lora-alpha" if lora_alpha is not None else "--adapter-only"
            raise UsageError(
                f"{flag}: for an adapter trained inside BASE (merge-lora BASE DST); "
                f"{adapter}'s adapter_config.json says how it was trained"
            )
        from ckptctl.lora.adapter import open_adapter  # torch and numpy: only when merging

        refuse_overlap("destination", dst, {"adapter": adapter})
        lora = open_adapter(adapter, settings.storage, settings.trusted_fields)
        _merge(out, base, dst, lora, settings, job, max_shard_size, as_json)


def _inside(
    out: Output,
    base: str,
    dst: str,
    settings: Settings,
    job: JobRequest,
    alpha: float | None,
    adapter_only: bool,
    max_shard_size: str,
) -> None:
    """The adapter a checkpoint was trained with, merged into its base or exported."""
    from ckptctl.pipeline.probe import open_checkpoint

    refuse_overlap("destination", dst, {"source": base})
    ckpt = open_checkpoint(base, settings, with_adapter=True, **job.source_options())
    if ckpt.adapter is None:
        raise UsageError(
            f"{base}: holds no LoRA adapter; give the adapter's directory: ckptctl merge-lora "
            f"{base} ADAPTER DST"
        )
    if ckpt.adapter.alone and not adapter_only:
        raise UsageError(
            f"{base}: holds a LoRA adapter without its base weights (saved alone); give the "
            f"model the run started from: ckptctl merge-lora BASE {base} DST"
        )
    lora = _embedded(ckpt, base, _alpha(alpha, ckpt, base))
    if adapter_only:
        _export(out, lora, dst, settings, job)
    else:
        _merge(out, base, dst, lora, settings, job, max_shard_size, out.as_json, ckpt)


def _embedded(ckpt: Checkpoint, url: str, alpha: float) -> HeldAdapter:
    """The adapter ``ckpt`` holds: by PEFT's names, or Megatron-Bridge's in ``torch_dist``."""
    from ckptctl.lora.embedded import EmbeddedAdapter
    from ckptctl.lora.megatron import MegatronAdapter

    assert ckpt.adapter is not None
    if ckpt.adapter.megatron:
        return MegatronAdapter.from_checkpoint(ckpt, url, alpha)
    return EmbeddedAdapter(ckpt, url, alpha)


def _peft_directory(url: str, settings: Settings) -> bool:
    """Whether ``url`` is a PEFT adapter directory (else: a checkpoint trained with one)."""
    from ckptctl.io.storage import Storage
    from ckptctl.lora.adapter import CONFIG

    storage = Storage(url, settings.storage, read_only=True)
    return not storage.exists() or not storage.isdir() or storage.exists(CONFIG)


def _alpha(given: float | None, ckpt: Checkpoint, url: str) -> float:
    """The alpha the adapter ``ckpt`` holds was trained with: as the run recorded it (a
    different ``--lora-alpha`` is refused), else as given."""
    assert ckpt.adapter is not None
    trained = ckpt.adapter.trained
    if trained is not None and trained.alpha is not None:
        if given is not None and given != trained.alpha:
            raise UsageError(
                f"--lora-alpha {given:g}: {trained.where} records the adapter's lora_alpha as "
                f"{trained.alpha:g}; leave the flag out to use it"
            )
        return trained.alpha
    if given is None:
        raise UsageError(
            f"--lora-alpha: {url} holds a LoRA adapter on {len(ckpt.adapter.modules)} modules "
            "but not the alpha it was trained with (its update's scale); give it (verl: "
            "actor_rollout_ref.model.lora_alpha)"
        )
    return given


def _held(
    out: Output,
    base: str,
    adapter: str,
    dst: str,
    settings: Settings,
    job: JobRequest,
    alpha: float | None,
    adapter_only: bool,
    max_shard_size: str,
) -> None:
    """The adapter a checkpoint holds (verl's LoRA actor, saved with or without its base)
    merged into BASE, or exported."""
    from ckptctl.pipeline.probe import open_checkpoint

    refuse_overlap("destination", dst, {"source": base, "adapter": adapter})
    ckpt = open_checkpoint(adapter, settings, with_adapter=True, **job.source_options())
    if ckpt.adapter is None:
        raise UsageError(
            f"{adapter}: neither a PEFT adapter directory (no adapter_config.json) nor a "
            "checkpoint trained with a LoRA adapter"
        )
    lora = _embedded(ckpt, adapter, _alpha(alpha, ckpt, adapter))
    if adapter_only:
        _export(out, lora, dst, settings, job)
    else:
        _merge(out, base, dst, lora, settings, job, max_shard_size, out.as_json)


def _megatron(
    out: Output,
    base: str,
    adapter: str,
    dst: str,
    settings: Settings,
    job: JobRequest,
    alpha: float | None,
    adapter_only: bool,
    max_shard_size: str,
) -> None:
    """Megatron-Bridge's adapter as verl saves it, made the PEFT adapter of BASE's HF model:
    merged into BASE, or exported."""
    from ckptctl.errors import LayoutError
    from ckptctl.lora.megatron import MegatronAdapter
    from ckptctl.pipeline.probe import open_checkpoint

    refuse_overlap("destination", dst, {"source": base, "adapter": adapter})
    if alpha is None:
        raise UsageError(
            f"--lora-alpha: {adapter} is Megatron-Bridge's LoRA adapter as verl saves it, "
            "which does not hold the alpha it was trained with (its update's scale); give it "
            "(verl: actor_rollout_ref.model.lora.alpha)"
        )
    ckpt = open_checkpoint(base, settings, **job.source_options())
    spec = ckpt.view.spec
    if spec is None:
        raise LayoutError(
            f"{base}: a base of a model ckptctl has no Megatron mapping for; the adapter's "
            "Megatron layers cannot be placed in it"
        )
    lora = MegatronAdapter.from_rank_files(adapter, settings.storage, spec, alpha, base)
    if adapter_only:
        _export(out, lora, dst, settings, job)
    else:
        _merge(out, base, dst, lora, settings, job, max_shard_size, out.as_json, ckpt)


def _merge(
    out: Output,
    base: str,
    dst: str,
    lora: LoraSource,
    settings: Settings,
    job: JobRequest,
    max_shard_size: str,
    as_json: bool,
    opened: Checkpoint | None = None,
) -> None:
    from ckptctl.lora.merge import LoraMerge
    from ckptctl.lora.plan import expert_routes, under_written_names, with_adapter

    planned = plan_consolidate(
        base,
        dst,
        "hf",
        settings,
        max_shard_bytes=parse_size(max_shard_size),
        opened=opened,
        **job.source_options(),
    )
    named = planned.sources.primary.view.hf_named  # read by name: its in-memory names
    under_written_names(lora, dict(named.model.hub_names) if named is not None else {})
    planned.plan = with_adapter(planned.plan, lora)
    planned.sources.adjust = LoraMerge(lora, expert_routes(planned.plan, lora))
    report = carry_out(out, planned, overwrite=job.overwrite, dry_run=job.dry_run)
    finish(out, planned.plan, report, as_json)


def _export(out: Output, lora: HeldAdapter, dst: str, settings: Settings, job: JobRequest) -> None:
    """The adapter as PEFT's ``save_pretrained`` writes one; a destination that holds anything
    but a previous export is refused, that one replaced only with ``--overwrite``."""
    from ckptctl.io.storage import Storage
    from ckptctl.lora.adapter import CONFIG, WEIGHTS
    from ckptctl.lora.embedded import write_adapter

    target = Storage(dst, settings.storage)
    held = set(target.find_files()) if target.exists() and target.isdir() else set()
    if target.exists() and not target.isdir():
        raise OutputExistsError(f"{dst} is a file, not a directory")
    if held and not (job.overwrite and held <= {CONFIG, WEIGHTS}):
        raise OutputExistsError(
            f"{dst} exists and is not empty",
            hint="choose another destination"
            + ("" if held - {CONFIG, WEIGHTS} else ", or pass --overwrite to replace the adapter"),
        )
    summary = {
        "operation": "export-adapter",
        "source_url": lora.url,
        "target_url": dst,
        "modules": len(lora.pairs),
        "r": lora.settings["r"],
        "lora_alpha": lora.settings["lora_alpha"],
        "tensors": len(lora.names()),
        "dry_run": job.dry_run,
    }
    if not job.dry_run:
        if held:
            target.remove(CONFIG)  # the config first: a half-replaced directory is no adapter
        summary["bytes_written"] = write_adapter(lora, target)
    if out.as_json:
        out.json(summary)
    else:
        verb = "would write" if job.dry_run else "wrote"
        out.show(
            f"export-adapter: {lora.url} -> {dst}: {verb} the LoRA adapter on "
            f"{summary['modules']} modules (r {summary['r']}, alpha {summary['lora_alpha']:g}) "
            "as a PEFT adapter directory"
        )
