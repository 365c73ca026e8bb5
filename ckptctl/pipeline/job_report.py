"""What a job reports and reads from, without the executor's tensor machinery: the CLI and
the job planners import this (and not torch) so that commands which touch no tensor start fast.
"""

from __future__ import annotations

import resource
import threading
from dataclasses import dataclass, field
from typing import Any

from ckptctl.checksums.manifest import recorded
from ckptctl.errors import CheckpointError
from ckptctl.io.runs import Run
from ckptctl.model.geometry import nbytes
from ckptctl.model.plan import COPY, FileWrite, Plan
from ckptctl.model.stored import FlatView, KeyPath, Shape


@dataclass
class Report:
    bytes_read: int = 0
    read_requests: int = 0
    bytes_written: int = 0
    files_written: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    tensor_checksums: dict[str, dict[str, str]] = field(default_factory=dict)
    """File -> tensor key -> xxh3-64 of its bytes, taken while streaming."""
    quantized: dict[str, dict[str, float]] = field(default_factory=dict)
    """File -> canonical tensor -> largest error of its part written in a lossy dtype
    (``--dtype fp8-block``), as a reader dequantizes it against the source's values."""
    records: dict[str, list[list[Any]]] = field(default_factory=dict)
    """DCP shard file -> its records ``[fqn, chunk offsets, byte offset, length]``."""
    copied: dict[str, int] = field(default_factory=dict)
    """Bytes moved without passing through this process, by how: ``copy_file_range`` (the
    kernel, local files) or ``upload_part_copy`` (the object store, server side)."""
    read_for_checks: list[int] = field(default_factory=lambda: [0, 0])
    """Records read again (local) or fetched (object stores) only to check their CRC-32,
    and the bytes: records the job read in part (rows past a vocabulary cut, or the part the
    other files take, checked before the file that read the first part counts)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """A job run by several processes: each rank's own figures (the rest sums them)."""


def peak_rss_bytes() -> int:
    """This process's peak resident memory. On Linux from ``VmHWM``: ``ru_maxrss`` survives
    ``exec``, so a process started by a large parent would report the parent's peak."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


SERVER_COPY_MIN = 16 << 20
"""Smallest run of an object copied on the server: up to 5 MiB of it may complete the part
being uploaded, and S3's parts are at least 5 MiB; shorter boxes are read like any other."""


class Sources:
    """Routes reads to the checkpoint owning a path: the plan's source, or a further source
    (replica, full copy) whose files the plan names under a prefix such as ``@0/``."""

    def __init__(self, primary: Any, extra: dict[str, Any] | None = None) -> None:
        self.primary = primary
        self.extra = extra or {}
        self.server_copy_to: Any = None
        """The object store written to, when it is one: runs of its objects become server-side
        copies (``locate``)."""
        self.adjust: Any = None
        """A change made to the bands of some tensors as they are built (``merge-lora``'s
        ``LoraMerge``: ``covers(write)``, ``apply(write, lo, hi, dim, band)``); those tensors
        are always built in bands, never moved as runs of the source's bytes."""
        self._recorded: dict[int, Any] = {}
        """Each source's ckptctl manifest, read once (``check_copy``)."""
        self._recorded_lock = threading.Lock()

    def check_copy(self, path: str, algorithm: str, digest: str) -> None:
        """A source file copied whole hashed to ``digest``: where the source has a ckptctl
        manifest recording that file in the same algorithm, the two must agree, or the copy
        would carry a changed file into an output that vouches for it."""
        ckpt, rel = self.owner(path)
        with self._recorded_lock:
            if id(ckpt) not in self._recorded:
                self._recorded[id(ckpt)] = recorded(ckpt.storage)
            known = self._recorded[id(ckpt)]
        if known is None or known.algorithm != algorithm or rel not in known.files:
            return
        if known.files[rel] != digest:
            raise CheckpointError(
                f"{ckpt.storage.describe(rel)}: its bytes differ from the checksum its ckptctl "
                "manifest records; the file changed after it was written (ckptctl verify lists "
                "every damaged file)"
            )

    def file_bytes(self, plan: Plan, file: FileWrite) -> int:
        """Bytes a target file moves: its tensors', or the size of the source file it copies
        (what progress counts and what shares of a job on several processes balance)."""
        if file.kind == COPY:
            ckpt, rel = self.owner(plan.source_files[file.copy_of or 0])
            return int(ckpt.storage.size(rel))
        return sum(nbytes(t.shape, t.dtype) for t in file.tensors)

    def rounding_error(self, canonical: str) -> float | None:
        """The largest error the reads of ``canonical`` rounded it by, if they rounded it."""
        found = []
        for ckpt in (self.primary, *self.extra.values()):
            errors = ckpt.rounding_errors()
            if canonical in errors:
                found.append(errors[canonical])
        return max(found, default=None)

    def owner(self, path: str) -> tuple[Any, str]:
        for prefix, ckpt in self.extra.items():
            if path.startswith(prefix):
                return ckpt, path[len(prefix) :]
        return self.primary, path

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: Shape,
        sizes: Shape,
        view: FlatView = None,
        transposed: bool = False,
        into: Any = None,
    ) -> Any:
        """The box as a tensor (the owning reader's; this module does not import torch); the
        reader may fill ``into`` and return it instead (formats that say ``reads_into``)."""
        ckpt, rel = self.owner(path)
        if transposed:  # only formats that store tensors transposed take the flag
            return ckpt.read(rel, key, offsets, sizes, view, transposed=True)
        if into is not None and ckpt.reads_into:
            return ckpt.read(rel, key, offsets, sizes, view, into=into)
        return ckpt.read(rel, key, offsets, sizes, view)

    def extent(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> tuple[str, int, int] | None:
        """The local file and byte range ``(path, offset, nbytes)`` a read of the box touches,
        when its format can say (``extent``, or ``where`` for a box lying contiguously);
        ``None`` for object stores and formats that cannot."""
        ckpt, rel = self.owner(path)
        if not ckpt.storage.is_local:
            return None
        span = ckpt.extent(rel, key, offsets, sizes, view)
        return None if span is None else (ckpt.storage.path(span.rel), span.offset, span.nbytes)

    def locate(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Run | None:
        """The box as a run of a local source file (bytes that can move by kernel copy), when
        its format can say where it lies contiguously (``where``), or as a run of an object on
        the store being written to (``server_copy_to``) long enough to copy on the server;
        ``None`` otherwise (other object stores, compressed views: the box is read)."""
        ckpt, rel = self.owner(path)
        storage = ckpt.storage
        on_server = (
            storage.is_s3
            and self.server_copy_to is not None
            and storage.fs is self.server_copy_to.fs
        )
        if not (storage.is_local or on_server):
            return None
        span = ckpt.where(rel, key, offsets, sizes, view)
        if span is None:
            return None
        if storage.is_local:
            path = storage.path(span.rel)
            return Run(path, span.offset, span.nbytes, span.dtype, span.crc, record=span.record)
        if span.nbytes < SERVER_COPY_MIN:
            return None
        return Run(
            storage.describe(span.rel),
            span.offset,
            span.nbytes,
            span.dtype,
            span.crc,
            storage=storage,
            rel=span.rel,
        )
