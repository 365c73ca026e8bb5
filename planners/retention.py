"""Which checkpoints of a training run each storage tier keeps: a policy as a value.

Saves go to a fast local tier (NVMe) first and are copied to the data lake in the background.
The local tier holds the newest ``keep_local`` complete checkpoints (a restart on the same nodes
reads them at disk speed); the lake receives every ``lake_every``-th step (1: all of them) and
keeps what it receives. Pure: callers list what is stored and remove what this says.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Retention:
    keep_local: int = 2
    """Newest complete checkpoints kept on the local tier (at least 1: the latest)."""
    lake_every: int = 1
    """Copy steps divisible by this to the lake (1: every step; 0: none)."""

    def __post_init__(self) -> None:
        if self.keep_local < 1:
            raise ValueError(f"keep_local={self.keep_local}: the local tier keeps at least 1")
        if self.lake_every < 0:
            raise ValueError(f"lake_every={self.lake_every} is negative")

    def goes_to_lake(self, step: int) -> bool:
        return self.lake_every > 0 and step % self.lake_every == 0

    def local_to_remove(self, steps: Iterable[int]) -> list[int]:
        """Steps of complete local checkpoints to delete: all but the newest ``keep_local``."""
        ordered = sorted(set(steps))
        return ordered[: max(0, len(ordered) - self.keep_local)]
