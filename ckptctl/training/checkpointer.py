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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptctl.checksums.manifest import INCOMPLETE, MANIFEST
from ckptctl.errors import UsageError
from ckptctl.io.storage import Storage
from ckptctl.settings import StorageConfig
from ckptctl.training.coordination import Coordinator
from ckptctl.training.saving import Staged, begin, commit, rank_file, stage, write_rank
from ckptctl.training.state import TensorItem, assign_writers, items_of, resolve_stateful
from ckptctl.training.tiers import (
    Tiers,
    begin_lake_copy,
    copy_file,
    finish_lake_copy,
    manifest_of,
    prune_local,
)

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
    step: int | None = None
    lake_seconds: float = 0.0
    """With tiers: time to copy the committed checkpoint to the lake (0 if not copied)."""
    pruned: list[str] = field(default_factory=list)
    """With tiers: local checkpoints the retention policy removed after this save."""


@dataclass
class _Memory:
    """The last completed save, kept in host memory (``keep_in_memory``)."""

    checkpoint_id: str
    staged: dict[str, Staged]


class Checkpointer:
    """Saves and loads of one training process.

    ``keep_in_memory`` keeps the last save's staged copy of everything this rank holds, so
    ``load`` of that checkpoint in the same process reads memory, not storage (it costs one copy
    of the rank's state in host memory); ``memory_limit`` (bytes) bounds it: a larger state is
    not kept. ``tiers`` saves checkpoint ``name`` under a local root first, then copies it to
    the lake and applies the retention policy; ``load`` then takes the local copy when it is
    complete and the lake's otherwise."""

    def __init__(
        self,
        *,
        keep_in_memory: bool = False,
        memory_limit: int | None = None,
        storage: StorageConfig | None = None,
        tiers: Tiers | None = None,
        timeout_seconds: float = 600.0,
    ) -> None:
        self.keep_in_memory = keep_in_memory
        self.memory_limit = memory_limit
        self.storage_config = storage or StorageConfig()
        self.timeout_seconds = timeout_seconds
        self.tiers = tiers
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
        self, state_dict: Mapping[str, Any], *, checkpoint_id: str, step: int | None = None
    ) -> concurrent.futures.Future[SaveReport]:
        """Stage ``state_dict`` to host memory, then write it in the background; the future
        completes when the checkpoint is complete (every rank written, manifest last; with
        ``tiers``, also copied to the lake), or holds the error (on every rank) when any rank
        failed. ``step`` is recorded in the manifest; ``tiers`` need it (retention)."""
        start = time.perf_counter()
        if self.tiers is not None and step is None:
            raise UsageError("async_save: pass step= (the retention policy of tiers= needs it)")
        coordinator = self.coordinator()
        self.wait()
        name = str(checkpoint_id)
        tiers, config = self.tiers, self.storage_config
        storage = tiers.at(tiers.local, name, config) if tiers else Storage(name, config)
        items = items_of(resolve_stateful(state_dict))
        mine = assign_writers(items, coordinator.rank, coordinator.world)
        keep = self._keeps(items)
        staged = stage(items, mine, self._buffers, keep)
        self._buffers = staged
        self.memory = None  # its buffers now hold the new state
        report = SaveReport(name, time.perf_counter() - start, step=step)
        self._pending = self._pool.submit(self._write, storage, staged, sorted(items), keep, report)
        return self._pending

    def _keeps(self, items: Mapping[str, Any]) -> bool:
        """Whether this save stays in memory: asked for, and within ``memory_limit``."""
        if not self.keep_in_memory:
            return False
        size = sum(i.nbytes for i in items.values() if isinstance(i, TensorItem))
        if self.memory_limit is not None and size > self.memory_limit:
            log.warning(
                "ckptctl: not keeping this save in memory: %d bytes over memory_limit=%d",
                size,
                self.memory_limit,
            )
            return False
        return True

    def save(
        self, state_dict: Mapping[str, Any], *, checkpoint_id: str, step: int | None = None
    ) -> SaveReport:
        """``async_save`` and wait for it."""
        return self.async_save(state_dict, checkpoint_id=checkpoint_id, step=step).result()

    def wait(self) -> None:
        """Until the save in flight (if any) has finished; its error stays with its future."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
            self._pending = None

    def _everyone(self, what: str, action: Callable[[], Any]) -> list[Any]:
        """Run ``action`` on every rank; every rank gets every result, or the same error if
        any rank failed (so no rank goes on to a step the others will not reach)."""
        try:
            outcome: tuple[Any, str | None] = (action(), None)
        except Exception as err:
            outcome = (None, f"{type(err).__name__}: {err}")
        outcomes = self.coordinator().gather(outcome)
        for rank, (_, error) in enumerate(outcomes):
            if error is not None:
                raise RuntimeError(f"ckptctl: {what} failed on rank {rank}: {error}")
        return [value for value, _ in outcomes]

    def _rank0(self, what: str, action: Callable[[], Any]) -> Any:
        """Run ``action`` on rank 0 alone; every rank gets its result or its error."""
        outcome: tuple[Any, str | None] = (None, None)
        if self.coordinator().rank == 0:
            try:
                outcome = (action(), None)
            except Exception as err:
                outcome = (None, f"{type(err).__name__}: {err}")
        value, error = self.coordinator().from_rank0(outcome)
        if error is not None:
            raise RuntimeError(f"ckptctl: {what} failed on rank 0: {error}")
        return value

    def _write(
        self,
        storage: Storage,
        staged: dict[str, Staged],
        held: list[str],
        keep: bool,
        report: SaveReport,
    ) -> SaveReport:
        start = time.perf_counter()
        rank, name = self.coordinator().rank, report.checkpoint_id
        what = f"save to {storage.url}"
        # Every rank's client is ready while rank 0 marks the checkpoint incomplete, so all
        # ranks start streaming together (one rank's client built late would serialise them).
        storage.connect()
        self._rank0(what, lambda: begin(storage, name))
        results = self._everyone(what, lambda: write_rank(storage, rank, staged, held))
        manifest = self._rank0(what, lambda: commit(storage, name, results, report.step))
        report.files = [*sorted(manifest["files"]), MANIFEST]
        report.bytes_written = results[rank].size
        report.write_seconds = time.perf_counter() - start
        if keep:
            self.memory = _Memory(name, staged)
        tiers = self.tiers
        if tiers is not None:
            assert report.step is not None
            if tiers.retention.goes_to_lake(report.step):
                self._copy_to_lake(storage, tiers.at(tiers.lake, name, self.storage_config))
                report.lake_seconds = time.perf_counter() - start - report.write_seconds
            report.pruned = self._rank0(
                f"retention on {tiers.local}",
                lambda: prune_local(tiers.local, tiers.retention, self.storage_config),
            )
        log.info(
            "ckptctl: saved %s (blocked %.3f s, written in %.3f s)",
            name,
            report.blocked_seconds,
            report.write_seconds,
        )
        return report

    def _copy_to_lake(self, local: Storage, lake: Storage) -> None:
        """Each rank copies its own shard file; rank 0 commits the lake copy last."""
        what = f"copy to the lake ({lake.url})"
        rank = self.coordinator().rank
        self._rank0(what, lambda: begin_lake_copy(lake))

        def mine() -> int:
            files = manifest_of(local)["files"]
            own = rank_file(rank)
            return copy_file(local, lake, own, files[own]["checksum"]) if own in files else 0

        self._everyone(what, mine)
        self._rank0(what, lambda: finish_lake_copy(local, lake))

    def load(
        self,
        state_dict: dict[str, Any],
        *,
        checkpoint_id: str,
        full: str | None = None,
        no_dist: bool = False,
    ) -> Any:
        """Fill ``state_dict`` (a template: its tensors' shapes and placements say what this
        rank needs) in place from ``checkpoint_id``; ``full`` names a full checkpoint of the
        same step to cut boxes from when files of the sharded one are lost. Every rank calls
        it (as ``torch.distributed.checkpoint.load``): the ranks check the records they read
        in parts together, and fail together. ``no_dist`` (as torch's): this process loads
        alone, whatever the other ranks do (an export on rank 0); it then checks the records
        it read in parts by reading the bytes it did not."""
        from ckptctl.training.loading import load_into

        self.wait()
        name = str(checkpoint_id)
        memory = self.memory if self.memory and self.memory.checkpoint_id == name else None
        coordinator = None if no_dist else self.coordinator()
        return load_into(
            state_dict,
            self._where(name),
            self.storage_config,
            full=full,
            memory=memory.staged if memory else None,
            gather=coordinator.gather if coordinator else lambda obj: [obj],
            rank=coordinator.rank if coordinator else 0,
        )

    def _where(self, name: str) -> str:
        """Without tiers ``name`` itself; with them the local copy when it is complete (this
        node kept it), else the lake's (a replaced node, or retention removed it)."""
        if self.tiers is None:
            return name
        local = self.tiers.at(self.tiers.local, name, self.storage_config)
        if local.exists(MANIFEST) and not local.exists(INCOMPLETE):
            return local.url
        return self.tiers.at(self.tiers.lake, name, self.storage_config).url

    def close(self) -> None:
        """Wait for the last save, then tear down the ranks' own group (called on every rank,
        before the job destroys its process group). A save after ``close`` makes a new one."""
        self.wait()
        if self._coordinator is not None:
            self._coordinator.close()
            self._coordinator = None
