"""Where a job reports the bytes it has moved: the CLI renders it, tests may count it. Below
every package that runs jobs (pipeline, compression, training), so none imports another for
it."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Where the executor reports bytes written; the CLI renders it, tests may count it."""

    def start(self, total_bytes: int, description: str) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def finish(self) -> None: ...


class NoProgress:
    def start(self, total_bytes: int, description: str) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass
