"""How the ranks of a training job agree on a save without disturbing training.

Background writes talk over their own gloo process group, made once (collectively, on the
training thread, at the first save): collectives on the training job's default group must be
issued in the same order on every rank, and a background thread issuing them at arbitrary times
would interleave with the training loop's own. gloo runs on the host, so it also works when
training uses NCCL. A rank that dies stops the others' collectives after ``timeout``; its save
then fails everywhere and is never marked complete.

The group is torn down while the interpreter is whole: by ``close`` (every rank), or, for a job
that never closes its checkpointer, at exit. A gloo group whose last reference goes only while
the interpreter finalizes can abort the process ("terminate called without an active
exception") after the job's work is done.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger("ckptctl")
_open: weakref.WeakSet[Coordinator] = weakref.WeakSet()


class Coordinator:
    def __init__(self, timeout_seconds: float) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self._group: Any = None
        if self.distributed and self.world > 1:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
            _open.add(self)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self._live())
        return out

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._live())
        return box[0]

    def _live(self) -> Any:
        # A closed group must not pass for a job of one rank: each rank would commit alone.
        if self._group is None:
            raise RuntimeError("the checkpointer's process group is closed")
        return self._group

    def close(self) -> None:
        """Called on every rank: the ranks meet on the group, so none closes its connections
        while another still reads its last message, then each destroys it."""
        group, self._group = self._group, None
        _open.discard(self)
        if group is None or not dist.is_initialized():
            return  # the job destroyed every group already: dropping ours is all that is left
        try:
            dist.barrier(group=group)
        except RuntimeError as err:  # a rank gone: nothing to wait for, tear down anyway
            log.warning("checkpointer: ranks did not meet to close their group: %s", err)
        with contextlib.suppress(ValueError):  # the job destroyed this one group itself
            dist.destroy_process_group(group)

    def release(self) -> None:
        """Drop the group without meeting the other ranks (at exit)."""
        self._group = None


@atexit.register
def _release_at_exit() -> None:
    for coordinator in list(_open):
        coordinator.release()
