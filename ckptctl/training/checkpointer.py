"""The training loop's checkpointer: ``save``, ``async_save`` and ``load`` with the signatures
of ``torch.distributed.checkpoint``, called on every rank.

``async_save`` holds the training loop only while the state is copied to host memory; the
writing (and the commit by rank 0 once every rank is done) runs on one background thread per
process, so saves are written in the order they were made and a new one stages only after the
previous one has finished with its buffers.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptctl.manifest import MANIFEST
from ckptctl.settings import StorageConfig
from ckptctl.storage import Storage
from ckptctl.training.coordination import Coordinator
from ckptctl.training.saving import RankResult, Staged, begin, commit, stage, write_rank
from ckptctl.training.state import assign_writers, items_of, resolve_stateful

log = logging.getLogger("ckptctl")


@dataclass
class SaveReport:
    checkpoint_id: str
    blocked_seconds: float
    """How long the training loop waited (staging to host memory)."""
    write_seconds: float = 0.0
    """Background time from the end of staging to the checkpoint being complete."""
    bytes_written: int = 0
    """By this rank."""
    files: list[str] = field(default_factory=list)
    """Files of the whole checkpoint (known on every rank after the commit)."""


@dataclass
class _Memory:
    """The last completed save, kept in host memory (``keep_in_memory``)."""

    checkpoint_id: str
    staged: dict[str, Staged]


class Checkpointer:
    """Saves and loads of one training process. ``keep_in_memory`` keeps the last save's staged
    copy of everything this rank holds, so ``load`` of that checkpoint in the same process
    reads memory, not storage (it costs one copy of the rank's state in host memory)."""

    def __init__(
        self,
        *,
        keep_in_memory: bool = False,
        storage: StorageConfig | None = None,
        timeout_seconds: float = 600.0,
    ) -> None:
        self.keep_in_memory = keep_in_memory
        self.storage_config = storage or StorageConfig()
        self.timeout_seconds = timeout_seconds
        self._coordinator: Coordinator | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckptctl-save")
        self._pending: concurrent.futures.Future[SaveReport] | None = None
        self._buffers: dict[str, Staged] = {}
        self.memory: _Memory | None = None

    def coordinator(self) -> Coordinator:
        if self._coordinator is None:
            self._coordinator = Coordinator(self.timeout_seconds)
        return self._coordinator

    def async_save(
        self, state_dict: Mapping[str, Any], *, checkpoint_id: str
    ) -> concurrent.futures.Future[SaveReport]:
        """Stage ``state_dict`` to host memory, then write it in the background; the future
        completes when the checkpoint is complete (every rank written, manifest last), or
        holds the error (on every rank) when any rank failed."""
        start = time.perf_counter()
        coordinator = self.coordinator()
        self.wait()
        storage = Storage(str(checkpoint_id), self.storage_config)
        items = items_of(resolve_stateful(state_dict))
        mine = assign_writers(items, coordinator.rank, coordinator.world)
        staged = stage(items, mine, self._buffers, self.keep_in_memory)
        self._buffers = staged
        self.memory = None  # its buffers now hold the new state
        report = SaveReport(str(checkpoint_id), time.perf_counter() - start)
        self._pending = self._pool.submit(self._write, storage, staged, report)
        return self._pending

    def save(self, state_dict: Mapping[str, Any], *, checkpoint_id: str) -> SaveReport:
        """``async_save`` and wait for it."""
        return self.async_save(state_dict, checkpoint_id=checkpoint_id).result()

    def wait(self) -> None:
        """Until the save in flight (if any) has finished; its error stays with its future."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
            self._pending = None

    def _write(self, storage: Storage, staged: dict[str, Staged], report: SaveReport) -> SaveReport:
        start = time.perf_counter()
        coordinator = self.coordinator()
        checkpoint_id = report.checkpoint_id
        problem = None
        if coordinator.rank == 0:
            try:
                begin(storage, checkpoint_id)
            except Exception as err:  # every rank must reach the collective below
                problem = f"{type(err).__name__}: {err}"
        problem = coordinator.from_rank0(problem)
        if problem is None:
            try:
                result = write_rank(storage, coordinator.rank, staged)
            except Exception as err:
                result = RankResult(coordinator.rank, error=f"{type(err).__name__}: {err}")
            results = coordinator.gather(result)
            if coordinator.rank == 0:
                try:
                    manifest = commit(storage, checkpoint_id, results)
                    problem = {"files": [*sorted(manifest["files"]), MANIFEST]}
                except Exception as err:
                    problem = f"{type(err).__name__}: {err}"
            problem = coordinator.from_rank0(problem)
            report.bytes_written = result.size
        if isinstance(problem, str):
            raise RuntimeError(f"ckptctl: save to {checkpoint_id} failed: {problem}")
        report.files = problem["files"]
        report.write_seconds = time.perf_counter() - start
        if self.keep_in_memory:
            self.memory = _Memory(checkpoint_id, staged)
        log.info(
            "ckptctl: saved %s (blocked %.3f s, written in %.3f s)",
            checkpoint_id,
            report.blocked_seconds,
            report.write_seconds,
        )
        return report

    def load(
        self, state_dict: dict[str, Any], *, checkpoint_id: str, full: str | None = None
    ) -> Any:
        """Fill ``state_dict`` (a template: its tensors' shapes and placements say what this
        rank needs) in place from ``checkpoint_id``; ``full`` names a full checkpoint of the
        same step to cut boxes from when files of the sharded one are lost."""
        from ckptctl.training.loading import load_into

        self.wait()
        memory = self.memory if self.memory and self.memory.checkpoint_id == checkpoint_id else None
        return load_into(
            state_dict,
            str(checkpoint_id),
            self.storage_config,
            full=full,
            memory=memory.staged if memory else None,
        )

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
