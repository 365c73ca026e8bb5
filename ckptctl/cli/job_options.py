"""How a writing command (consolidate, reshard) runs, whatever it writes: the options every
such job takes, read into its settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ckptctl.cli.options import (
    Checksum,
    ChecksumName,
    DryRun,
    Iteration,
    MemoryBudget,
    Overwrite,
    PlanFile,
    StageDir,
    TrueVocab,
    Workers,
    command_settings,
    parse_size,
)
from ckptctl.errors import UsageError
from ckptctl.settings import REMOTE_FILES_AT_ONCE, Settings

ReadParallel = Annotated[
    int | None,
    typer.Option(
        "--read-parallel",
        help="Reads in flight: bands built at once from a local disk, ranged GETs from an "
        "object store (default: one per core, 2-16, for a local disk; 8 for an object store).",
    ),
]
FilesAtOnce = Annotated[
    int | None,
    typer.Option(
        "--files-at-once",
        help="Files of the target written at once (default: on a local disk one per core, "
        f"2-16; to an object store {REMOTE_FILES_AT_ONCE}); they share --memory-budget.",
    ),
]


@dataclass(frozen=True)
class JobRequest:
    """How a writing command (consolidate, reshard) runs, whatever it writes."""

    plan_file: Path | None
    memory_budget: str
    """As given; read in ``settings`` (inside the command's error boundary)."""
    checksum: str
    stage_dir: str | None
    dry_run: bool
    overwrite: bool
    iteration: int | None
    true_vocab_size: int | None
    workers: int = 1
    read_parallel: int | None = None
    files_at_once: int | None = None

    def settings(self, ctx: typer.Context) -> Settings:
        budget = parse_size(self.memory_budget)
        if budget < 1:
            raise UsageError(f"--memory-budget {self.memory_budget}: must be positive")
        for flag, value in (
            ("--read-parallel", self.read_parallel),
            ("--files-at-once", self.files_at_once),
        ):
            if value is not None and value < 1:
                raise UsageError(f"{flag} {value}: must be at least 1")
        return command_settings(
            ctx,
            memory_budget=budget,
            checksum=self.checksum,
            stage_dir=self.stage_dir,
            read_parallel=self.read_parallel,
            files_at_once=self.files_at_once,
        )

    def source_options(self) -> dict[str, Any]:
        """How the source is read (keyword arguments of the ``ckptctl.pipeline.jobs`` planners)."""
        return {"iteration": self.iteration, "true_vocab_size": self.true_vocab_size}


def job_request(
    plan_file: PlanFile = None,
    memory_budget: MemoryBudget = "1GiB",
    checksum: Checksum = ChecksumName.xxh3_64,
    stage_dir: StageDir = None,
    dry_run: DryRun = False,
    overwrite: Overwrite = False,
    iteration: Iteration = None,
    true_vocab_size: TrueVocab = None,
    workers: Workers = 1,
    read_parallel: ReadParallel = None,
    files_at_once: FilesAtOnce = None,
) -> JobRequest:
    return JobRequest(
        plan_file,
        memory_budget,
        checksum.value,
        stage_dir,
        dry_run,
        overwrite,
        iteration,
        true_vocab_size,
        workers,
        read_parallel,
        files_at_once,
    )
