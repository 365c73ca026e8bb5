"""How the ranks of a training job agree on a save without disturbing training.

Background writes talk over their own gloo process group, made once (collectively, on the
training thread, at the first save): collectives on the training job's default group must be
issued in the same order on every rank, and a background thread issuing them at arbitrary times
would interleave with the training loop's own. gloo runs on the host, so it also works when
training uses NCCL. A rank that dies stops the others' collectives after ``timeout``; its save
then fails everywhere and is never marked complete.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


class Coordinator:
    def __init__(self, timeout_seconds: float) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self._group: Any = None
        if self.distributed and self.world > 1:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self._group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self._group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]
