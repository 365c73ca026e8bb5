"""Running a job from the CLI (consolidate, reshard, demo): check the destination, then warn,
then write with a progress bar, then report as text or one JSON document."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import typer

from ckptctl.cli.output import Output
from ckptctl.cli.units import human_bytes
from ckptctl.errors import CkptctlError
from ckptctl.formats.torch_dist.optimizer_form import optimizer_form
from ckptctl.io.storage import Storage
from ckptctl.model.plan import Plan
from ckptctl.model.stored import Format
from ckptctl.pipeline.destination import Destination, check_destination
from ckptctl.pipeline.distributed import Group, from_environment, launch, launched_world
from ckptctl.pipeline.job_report import Report
from ckptctl.pipeline.jobs import Job, run
from ckptctl.progress import NoProgress
from planners.target import changes


def launch_workers(workers: int, dry_run: bool = False) -> None:
    """``--workers K`` (outside torchrun): run this same command as K processes and exit with
    their outcome. Under torchrun, or in one of those processes, go on as one rank."""
    if workers > 1 and not dry_run and launched_world() == 1:
        raise typer.Exit(launch(workers, sys.argv[1:]))


def carry_out(
    out: Output, job: Job, *, overwrite: bool = False, dry_run: bool = False, quiet: bool = False
) -> Report | None:
    """Nothing is written, and no warning printed, before every check has passed. Launched as
    one rank of several (torchrun, ``--workers``), only rank 0 speaks and checks the
    destination; every rank first checks that all planned the same job."""
    if dry_run:
        _warn_notes(out, job.plan, quiet)
        return None
    group = from_environment()
    try:
        if group is None:
            destination = check_destination(job.plan, job.settings, overwrite=overwrite)
        else:
            out.silent = group.rank != 0
            destination = _checked_by_rank0(job, group, overwrite)
        if destination.complete:
            out.info(f"{job.plan.target_url} is already complete for this plan; nothing to do")
            return Report(files_written=[])
        progress: Any = NoProgress() if quiet else out.progress()
        return run(job, destination, progress, group, lambda: _warn_notes(out, job.plan, quiet))
    finally:
        if group is not None:
            group.close()  # gloo's threads end before the interpreter does


def _checked_by_rank0(job: Job, group: Group, overwrite: bool) -> Destination:
    """The same plan everywhere, then rank 0 alone checks (and clears) the destination."""
    prints = group.all_gather(job.plan.shared_fingerprint())
    if len(set(prints)) > 1:
        differ = ", ".join(f"rank {r}: {fp}" for r, fp in enumerate(prints))
        raise CkptctlError(
            f"the ranks planned different jobs (plan fingerprints {differ}); every rank must "
            "run the same command on the same source (a copy of it per node must keep its "
            "files' sizes and modification times: cp -a, rsync -a)"
        )
    destination, failure = None, None
    if group.rank == 0:
        try:
            destination = check_destination(job.plan, job.settings, overwrite=overwrite)
            if destination.clear_first:
                destination.storage.remove("")
                destination = replace(destination, clear_first=False)
        except CkptctlError as err:
            failure = err
    group.agree(None if failure is None else str(failure))
    if failure is not None:
        raise failure
    complete = group.all_gather(destination.complete if destination else None)[0]
    if destination is None:
        target = Storage(job.plan.target_url, job.settings.storage)
        destination = Destination(target, complete=complete)
    return destination


def _warn_notes(out: Output, plan: Plan, quiet: bool) -> None:
    if not quiet:
        for note in plan.notes:
            out.note(note)
        for warning in plan.warnings:
            out.warn(warning)


def report_dict(plan: Plan, report: Report) -> dict[str, Any]:
    return {
        "operation": plan.operation,
        "source": plan.source_url,
        "target": plan.target_url,
        "target_format": plan.target_format,
        "target_layout": plan.target_layout.model_dump(mode="json"),
        "plan_fingerprint": plan.fingerprint(),
        "files": report.files_written,
        "bytes_read": report.bytes_read,
        "read_requests": report.read_requests,
        "read_for_record_checks": {
            "records": report.read_for_checks[0],
            "bytes": report.read_for_checks[1],
        },
        "strategy": plan.strategy,
        "estimates": plan.estimates.model_dump(mode="json"),
        "bytes_written": report.bytes_written,
        "bytes_copied_without_passing_through": dict(report.copied),
        "seconds": round(report.seconds, 3),
        "throughput_bytes_per_s": int(report.bytes_written / report.seconds)
        if report.seconds
        else 0,
        "peak_rss_bytes": report.peak_rss_bytes,
        "notes": list(plan.notes),
        "warnings": list(plan.warnings),
        **({"ranks": report.ranks} if report.ranks else {}),
    }


def finish(out: Output, plan: Plan, report: Report | None, as_json: bool) -> None:
    """The plan (dry run) or the summary of what was done, as text or one JSON document."""
    if report is None:
        _show_plan(out, plan, as_json)
    elif as_json:
        out.json(report_dict(plan, report))
    else:
        out.show(
            f"{plan.operation}: {plan.source_url} ({describe_side(plan, source=True)}) -> "
            f"{plan.target_url} ({describe_side(plan, source=False)}): "
            f"{len(report.files_written)} files, read "
            f"{human_bytes(report.bytes_read)}, wrote {human_bytes(report.bytes_written)} in "
            f"{report.seconds:.1f} s, peak RSS {human_bytes(report.peak_rss_bytes)}"
        )


def describe_side(plan: Plan, *, source: bool) -> str:
    """One side of a job in full: format, layout, and what it holds; the target also says
    what changed (what the user did not give keeps the source's value, ``planners.target``)."""
    fmt = plan.source_format if source else plan.target_format
    if fmt == Format.HF:  # an HF Trainer's checkpoint-N/ keeps its optimizer's state beside
        moved = source and _holds_optimizer(plan)
        return "hf safetensors" + (
            " and the trainer's optimizer state" if moved else ", weights only"
        )
    layout = plan.source_layout if source else plan.target_layout
    mesh = plan.source_mesh if source else _target_mesh(plan)
    text = f"{fmt} {layout.describe()}{_on_mesh(mesh)}"
    if not source:
        form = optimizer_form(plan)
        text += f" ({form})" if form else ""
        text += ", with optimizer state" if _holds_optimizer(plan) else ", weights only"
        changed = changes(plan.source_layout, plan.target_layout)
        if plan.source_format != fmt:
            changed.insert(0, f"format {plan.source_format} -> {fmt}")
        if (
            plan.source_mesh
            and mesh
            and plan.source_mesh != mesh
            and 2 in (len(plan.source_mesh), len(mesh))
        ):
            before, after = ("x".join(map(str, m)) for m in (plan.source_mesh, mesh))
            changed.append(f"device mesh {before} -> {after}")  # not said by the layout
        text += f"; changed: {', '.join(changed)}" if changed else "; layout unchanged"
    return text


def _target_mesh(plan: Plan) -> tuple[int, ...]:
    return next((f.mesh for f in plan.files if f.mesh), ())


def _on_mesh(mesh: tuple[int, ...]) -> str:
    if len(mesh) == 2:
        return f" on an HSDP mesh of {mesh[0]} replicas x {mesh[1]} shards"
    return f" on one FSDP2 mesh of {mesh[0]}" if mesh else ""


def _holds_optimizer(plan: Plan) -> bool:
    return any("/" in t.canonical for f in plan.files for t in f.tensors) or any(
        f.kind == "copy" for f in plan.files
    )


def _show_plan(out: Output, plan: Plan, as_json: bool) -> None:
    if as_json:
        out.json(plan.model_dump(mode="json"))
        return
    e = plan.estimates
    out.show(
        f"{plan.operation} {plan.source_url} -> {plan.target_url}: {plan.strategy}: {plan.reason}\n"
        f"from: {describe_side(plan, source=True)}\n"
        f"to: {describe_side(plan, source=False)}\n"
        f"{len(plan.files)} files; read {human_bytes(e.bytes_read)} in {e.read_requests} "
        f"requests, write {human_bytes(e.bytes_written)}, peak memory "
        f"~{human_bytes(e.peak_memory_bytes)}"
    )
