"""The progress bar of jobs on a terminal (rich's, by bytes, on stderr). A module of its own so
that commands without one (``--json``, ``--quiet``, other ranks) never import it (~30 ms)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TimeRemainingColumn,
)
from rich.text import Text

from ckptctl.cli.units import human_bytes


class _BinarySpeed(ProgressColumn):
    """Transfer speed in MiB/s (rich's own column prints decimal MB/s)."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(
            "?" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed"
        )


class RichProgress:
    """Adapts ckptctl's progress sink to a rich progress bar by bytes on stderr."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(binary_units=True),
            _BinarySpeed(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task: Any = None

    def start(self, total_bytes: int, description: str) -> None:
        self._progress.start()
        self._task = self._progress.add_task(description, total=total_bytes)

    def advance(self, nbytes: int) -> None:
        self._progress.advance(self._task, nbytes)

    def finish(self) -> None:
        self._progress.stop()
