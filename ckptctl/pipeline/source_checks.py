"""The record checks of a job's sources: each opened source storage owns its own
(``RecordChecks``), and a job reading several (a plan's source and its replicas or full copy)
asks all of them at once. A record belongs to one storage's checks; asked about records or
files it never saw, the others answer that nothing is pending."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckptctl.checksums.record_checks import Key, Record, RecordChecks


class SourceChecks:
    def __init__(self, checkpoints: Iterable[Any]) -> None:
        own: dict[int, RecordChecks] = {}
        for ckpt in checkpoints:
            own.setdefault(id(ckpt.storage.checks), ckpt.storage.checks)
        self.all = list(own.values())
        self.primary = self.all[0]

    def read_again(self) -> tuple[int, int]:
        """Records the checks read bytes of themselves so far, and those bytes."""
        counts = [checks.read_again() for checks in self.all]
        return sum(n for n, _ in counts), sum(b for _, b in counts)

    def settle(self, paths: list[str], *, leave_parts: bool = False) -> set[Key]:
        """``RecordChecks.settle`` of every source's checks; the records left in parts."""
        waiting: set[Key] = set()
        for checks in self.all:
            waiting |= checks.settle(paths, leave_parts=leave_parts)
        return waiting

    def checked(self, keys: set[Key]) -> bool:
        return all(checks.checked(keys) for checks in self.all)

    def check_now(self, keys: set[Key]) -> None:
        for checks in self.all:
            checks.check_now(keys)

    def describe(self, keys: set[Key]) -> list[dict[str, Any]] | None:
        described: list[dict[str, Any]] = []
        for checks in self.all:
            mine = checks.describe(keys)
            if mine is None:
                return None
            described += mine
        return described

    def ask_again(self, described: dict[str, Any]) -> Key | None:
        """Queue the check of a record a stopped run left unchecked (a local file, read whole
        now); how ``checked`` names it."""
        record: Record = self.primary.from_description(described)
        self.primary.ask(record)
        return self.primary.key_of(record)
