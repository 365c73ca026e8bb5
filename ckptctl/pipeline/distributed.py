"""One job on several processes: the process group (torchrun's environment, gloo on CPU) and
the launcher behind ``--workers K``, which starts K processes as torchrun would.

Every process plans the same job; ranks compare plan fingerprints before writing anything,
each writes its share of the target files, and rank 0 commits (finish files, manifest) only
after every rank has sent the checksums of its files. Progress travels through the group's
key-value store, so rank 0 can show the whole job's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import CkptctlError

WORLD_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankError(CkptctlError):
    """Another rank failed or disagrees: this one stops without writing anything more."""

    exit_code = 1
    from_another_rank = True


@dataclass
class Group:
    """The processes of one job (a torch.distributed gloo group)."""

    rank: int
    world: int
    _store: Any = None

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def agree(self, failure: str | None) -> None:
        """Every rank says whether it may go on; all stop if one may not (each with the
        first rank's reason)."""
        reasons = self.all_gather(failure)
        bad = [(r, why) for r, why in enumerate(reasons) if why]
        if bad:
            rank, why = bad[0]
            if rank == self.rank:
                return  # this rank raises its own error
            raise RankError(f"rank {rank} stopped the job: {why}")

    def report_progress(self, nbytes: int) -> None:
        if self._store is not None:
            self._store.set(f"ckptctl/progress/{self.rank}", str(nbytes))

    def progress(self) -> list[int]:
        """Bytes each rank has written so far (as last reported)."""
        if self._store is None:
            return [0] * self.world
        out = []
        for r in range(self.world):
            key = f"ckptctl/progress/{r}"
            out.append(int(self._store.get(key)) if self._store.check([key]) else 0)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def launched_world() -> int:
    """How many processes the launcher (torchrun, ``--workers``) started for this job: 1 when
    this process runs alone."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def from_environment() -> Group | None:
    """The job's process group when launched by torchrun (or ``--workers``), else None."""
    world = launched_world()
    if world <= 1:
        return None
    missing = [name for name in WORLD_ENV if name not in os.environ]
    if missing:
        raise CkptctlError(
            f"WORLD_SIZE={world} but {', '.join(missing)} unset: launch with torchrun or "
            "--workers, which set them"
        )
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    group = Group(dist.get_rank(), dist.get_world_size())
    try:
        group._store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError):  # progress then shows this rank's bytes only
        group._store = None
    return group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(workers: int, argv: Sequence[str]) -> int:
    """Run ``ckptctl *argv`` as ``workers`` processes on this machine, as torchrun would
    (rank 0's output is the job's); when one fails the others are stopped. Returns the exit
    code: 0, or the first failing rank's."""
    port = _free_port()
    procs = []
    for rank in range(workers):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(workers),
            LOCAL_WORLD_SIZE=str(workers),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        stdout = None if rank == 0 else subprocess.DEVNULL  # one rank speaks for the job
        procs.append(
            subprocess.Popen([sys.executable, "-m", "ckptctl", *argv], env=env, stdout=stdout)
        )
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return 128 - failed[0] if failed[0] < 0 else failed[0]  # killed: as a shell says
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
