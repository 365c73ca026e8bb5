"""The executor: carry out a ``Plan``, one tensor at a time, and commit by writing markers last.

Memory holds one target tensor (plus the source box being copied into it) at a time: each target
file is streamed (safetensors header or torch pickle first, then tensor bytes in order), so peak
memory follows the largest tensor, not the checkpoint.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from math import prod
from typing import Any, Protocol

import torch
import xxhash

from ckptctl.formats.dcp.reader import DcpCheckpoint
from ckptctl.formats.hf.reader import write_safetensors
from ckptctl.formats.megatron.reader import (
    MegatronCheckpoint,
    args_for,
    args_from_spec,
    carried_state,
    distributed_optimizer_entry,
    rank_tree,
)
from ckptctl.formats.torch_dist.writer import (
    torch_dist_directory_files,
    torch_dist_directory_names,
    write_dcp_shard,
    write_state_dict_file,
)
from ckptctl.formats.torchsave.archive import (
    TensorRef,
    TensorSlot,
    tensor_bytes,
    write_torch_zip,
)
from ckptctl.manifest import MANIFEST, RunLog, new_digest, write_manifest
from ckptctl.model.catalog import parameters
from ckptctl.model.plan import FileKind, FileWrite, Plan, TensorWrite
from ckptctl.model.stored import Format
from ckptctl.prefetch import ReadAhead
from ckptctl.storage import Storage, write_in_slices


class Source(Protocol):
    def read(
        self,
        path: str,
        key: tuple[str | int, ...],
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        view: tuple[int, tuple[int, ...]] | None = None,
    ) -> torch.Tensor: ...


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
    records: dict[str, list[list[Any]]] = field(default_factory=dict)
    """DCP shard file -> its records ``[fqn, chunk offsets, byte offset, length]``."""


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


DEFAULT_MEMORY_BUDGET = 1 << 30


class Assembler:
    """Builds each target tensor from its copies, in bands of whole rows that fit the budget.

    A band is a slice of dim 0; tensors are row-major, so bands streamed in order are exactly the
    tensor's bytes. Each copy contributes the part of its box inside the band, read as one range.
    """

    def __init__(
        self,
        plan: Plan | tuple[str, ...],
        source: Source,
        report: Report,
        progress: Progress,
        budget: int,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        self.source_files = plan.source_files if isinstance(plan, Plan) else tuple(plan)
        self.source, self.report, self.progress = source, report, progress
        self.pool = pool
        # Up to four bands are alive (two queued for writing, one being written, one being
        # built); the one being built is held up to four times (output band, bytes read in
        # parallel, their contiguous copies, a dtype cast).
        self.band_bytes = max(budget // 8, 1) if pool is None else max(budget // 12, 1)

    def chunks(self, write: TensorWrite, file: str = "") -> Iterator[memoryview]:
        dtype = getattr(torch, write.dtype)
        shape = write.shape
        digest = xxhash.xxh3_64()
        if not shape:
            yield self._emit(self._band(write, dtype, 0, 1), digest)
        else:
            row_bytes = max(prod(shape[1:]) * dtype.itemsize, 1)
            rows = max(self.band_bytes // row_bytes, 1)
            for start in range(0, shape[0], rows):
                band = self._band(write, dtype, start, min(start + rows, shape[0]))
                yield self._emit(band, digest)
        key = ".".join(map(str, write.key))
        self.report.tensor_checksums.setdefault(file, {})[key] = digest.hexdigest()

    def _emit(self, band: torch.Tensor, digest: Any) -> memoryview:
        view = tensor_bytes(band)
        digest.update(view)
        self.report.bytes_written += len(view)
        self.progress.advance(len(view))
        return view

    def _band(self, write: TensorWrite, dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of the target tensor (the whole tensor if it is 0-dimensional)."""
        scalar = not write.shape
        shape = write.shape if scalar else (hi - lo, *write.shape[1:])
        if write.padding:
            out = torch.full(shape, write.fill, dtype=dtype)
        else:
            out = torch.empty(shape, dtype=dtype)
        reads = []
        for copy in write.copies:
            src, dst, sizes = copy.src, copy.dst, copy.sizes
            if not scalar:
                a, b = max(lo, dst[0]), min(hi, dst[0] + sizes[0])
                if a >= b:
                    continue
                src = (src[0] + a - dst[0], *src[1:])
                dst = (a - lo, *dst[1:])
                sizes = (b - a, *sizes[1:])
            path = self.source_files[copy.source]
            reads.append((dst, sizes, (path, copy.key, src, sizes, copy.view)))
        # The reads of a band are disjoint parts of it, so fetching them at once (from
        # different files and stores in parallel) stays within the band's memory.
        if self.pool is not None and len(reads) > 1:
            results = list(self.pool.map(lambda r: self.source.read(*r[2]), reads))
        else:
            results = [self.source.read(*r[2]) for r in reads]
        for (dst, sizes, _), data in zip(reads, results, strict=True):
            self.report.bytes_read += data.numel() * data.element_size()
            self.report.read_requests += 1
            box = tuple(slice(o, o + n) for o, n in zip(dst, sizes, strict=True))
            out[box] = data.to(dtype)
        return out


def _materialize(obj: Any, found: list[TensorRef]) -> Any:
    """Replace tensors inside carried training state by slots (their bytes are copied as-is)."""
    if isinstance(obj, TensorRef):
        found.append(obj)
        return TensorSlot(f"carried{len(found) - 1}", obj.dtype, obj.shape)
    if isinstance(obj, dict):
        return type(obj)((k, _materialize(v, found)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(_materialize(v, found) for v in obj)
    return obj


class Sources:
    """Routes reads to the checkpoint owning a path: the plan's source, or a further source
    (replica, full copy) whose files the plan names under a prefix such as ``@0/``."""

    def __init__(self, primary: Any, extra: dict[str, Any] | None = None) -> None:
        self.primary = primary
        self.extra = extra or {}

    def owner(self, path: str) -> tuple[Any, str]:
        for prefix, ckpt in self.extra.items():
            if path.startswith(prefix):
                return ckpt, path[len(prefix) :]
        return self.primary, path

    def read(
        self,
        path: str,
        key: tuple[str | int, ...],
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        view: tuple[int, tuple[int, ...]] | None = None,
    ) -> torch.Tensor:
        ckpt, rel = self.owner(path)
        return ckpt.read(rel, key, offsets, sizes, view)


def execute(
    plan: Plan,
    source: Source,
    target: Storage,
    progress: Progress | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    workers: int = 1,
    checksum: str = "xxh3_64",
) -> Report:
    """Write every file of ``plan`` to ``target``, then its finalize files in order.

    Tensor data in flight stays within about ``memory_budget`` bytes, whatever the tensor sizes.
    ``workers`` > 1 fetches the source ranges of a band in parallel (worth it on object
    storage; on a local disk it only adds allocator arenas, so the default is 1).
    """
    progress = progress or NoProgress()
    if not isinstance(source, Sources):
        source = Sources(source)
    report = Report()
    started = time.perf_counter()
    total = sum(_file_bytes(plan, f, source) for f in plan.files)
    progress.start(total, f"{plan.operation} -> {plan.target_url}")
    target.begin_writing()
    extra = torch_dist_directory_names(plan) if plan.target_format is Format.TORCH_DIST else ()
    log = RunLog(target, plan, checksum, extra)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptctl-read") if workers > 1 else None
    assemble = Assembler(plan, source, report, progress, memory_budget, pool)
    try:
        _write_files(plan, source, target, report, assemble, log)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    extra_files: list[str] = []
    if plan.target_format is Format.TORCH_DIST:
        state = training_state(plan, plan.files[0], source)
        for path, payload in torch_dist_directory_files(plan, report.records, state):
            with target.open_write(path, new_digest(checksum)) as out:
                out.write(payload)
            log.finished(path, {}, size=out.size, checksum=out.digest.hexdigest())
            extra_files.append(path)
    target.drain()  # staged uploads land before anything that says "complete"
    for text in plan.finalize:
        target.write_text(text.path, text.content)
        report.files_written.append(text.path)
    write_manifest(
        target, plan, report.tensor_checksums, log.done, algorithm=checksum, extra=extra_files
    )
    report.files_written.append(MANIFEST)
    progress.finish()
    report.seconds = time.perf_counter() - started
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def _write_files(
    plan: Plan,
    source: Sources,
    target: Storage,
    report: Report,
    assemble: Assembler,
    log: RunLog,
) -> None:
    for file in plan.files:
        reused = log.reusable(file.path)
        if reused is not None:  # resuming: this file was finished and is intact
            report.tensor_checksums[file.path] = reused["tensors"]
            report.records[file.path] = reused.get("records", [])
            assemble.progress.advance(_file_bytes(plan, file, source))
            report.files_written.append(file.path)
            continue
        with target.open_write(file.path, new_digest(log.algorithm)) as out:
            if file.kind is FileKind.SAFETENSORS:
                entries = [(str(t.key[0]), t.dtype, t.shape) for t in file.tensors]
                produce = partial(assemble.chunks, file=file.path)
                with ReadAhead(list(file.tensors), produce) as ahead:
                    write_safetensors(out, entries, lambda i, f=file: ahead(f.tensors[i]))
            elif file.kind is FileKind.COPY:
                _copy_file(source, plan.source_files[file.copy_of or 0], out, assemble)
            elif file.kind is FileKind.DISTRIBUTED_OPTIMIZER:
                _write_distopt_file(file, out, assemble)
            elif file.kind is FileKind.DCP_SHARD:
                report.records[file.path] = write_dcp_shard(plan, file, out, assemble)
            elif file.kind is FileKind.TORCH_SAVE:
                write_state_dict_file(file, source, out, assemble)
            else:
                _write_rank_file(plan, file, source, out, assemble)
        log.finished(
            file.path,
            report.tensor_checksums.get(file.path, {}),
            size=out.size,
            checksum=out.digest.hexdigest(),
            records=report.records.get(file.path),
        )
        report.files_written.append(file.path)


def _file_bytes(plan: Plan, file: FileWrite, source: Sources) -> int:
    """Bytes the progress bar counts for one target file: its tensors, or the whole source
    file it copies."""
    if file.kind is FileKind.COPY:
        ckpt, rel = source.owner(plan.source_files[file.copy_of or 0])
        return ckpt.storage.size(rel)
    return sum(prod(t.shape) * getattr(torch, t.dtype).itemsize for t in file.tensors)


def _copy_file(source: Sources, path: str, out: Any, assemble: Assembler) -> None:
    """A stored file as it is (direct strategy), streamed in bounded chunks."""
    ckpt, rel = source.owner(path)
    with ckpt.storage.open_read(rel) as f:
        while chunk := f.read(8 << 20):
            write_in_slices(out, chunk)
            assemble.report.bytes_read += len(chunk)
            assemble.report.bytes_written += len(chunk)
            assemble.progress.advance(len(chunk))


def _write_distopt_file(file: FileWrite, out: Any, assemble: Assembler) -> None:
    """``distrib_optim.pt``: each flat buffer streamed in offset order, gaps as zeros."""
    tree: dict[Any, Any] = {"buckets_coalesced": True}
    slots: list[TensorSlot] = []
    members: dict[TensorSlot, list[TensorWrite]] = {}
    for key, length in file.flat:
        gbuf, dtype_key, state = key
        param_dtype, grad_dtype = (getattr(torch, name) for name in str(dtype_key).split("|"))
        buffer = tree.setdefault(gbuf, {}).setdefault((param_dtype, grad_dtype), {})
        slot = TensorSlot(str(len(slots)), torch.float32, (length,))
        buffer.pop("numel_unpadded", None)  # Megatron writes it after the state tensors
        buffer[state] = slot
        buffer["numel_unpadded"] = length
        slots.append(slot)
        members[slot] = sorted(
            (t for t in file.tensors if t.key == key), key=lambda t: t.view_offset or 0
        )

    def produce(slot: TensorSlot) -> Iterator[memoryview]:
        pos = 0
        for write in members[slot]:
            assert write.view_offset is not None and write.view_offset >= pos
            yield from _zeros(write.view_offset - pos)
            yield from assemble.chunks(write, file.path)
            pos = write.view_offset + prod(write.shape)
        yield from _zeros(slot.shape[0] - pos)

    with ReadAhead(slots, produce) as ahead:
        write_torch_zip(out, tree, slots, ahead)


def _zeros(count: int, chunk: int = 1 << 20) -> Iterator[memoryview]:
    """``count`` fp32 zeros (alignment gaps of a flat buffer), in bounded chunks."""
    block = memoryview(bytes(4 * min(count, chunk)))
    while count > 0:
        n = min(count, chunk)
        yield block[: 4 * n]
        count -= n


@dataclass
class TrainingState:
    """What a target file carries besides tensors: args, counters, scheduler, group settings."""

    owner: Any
    template_path: str
    carried: Any
    args: Any
    templates: dict[bool, dict[str, Any]]
    optimizer_step: float | None
    refs: list[TensorRef]
    """Tensors inside the carried state, copied as they are (slots ``carried<i>``)."""

    def carried_slots(self) -> list[TensorSlot]:
        return [TensorSlot(f"carried{i}", r.dtype, r.shape) for i, r in enumerate(self.refs)]

    def carried_bytes(self, slot: TensorSlot) -> memoryview:
        ref = self.refs[int(slot.key.removeprefix("carried"))]
        return tensor_bytes(self.owner.read_ref(self.template_path, ref))


def training_state(plan: Plan, file: Any, source: Sources) -> TrainingState:
    refs: list[TensorRef] = []
    owner, template_path = source.owner(plan.source_files[file.carry_from or 0])
    if isinstance(owner, MegatronCheckpoint):
        carried = _materialize(carried_state(owner.tree(template_path)), refs)
        args = args_for(owner.args, plan.spec, plan.target_layout)
        templates = owner.group_templates
        optimizer_step = owner.view.optimizer_step if owner.view.has_optimizer else None
    elif isinstance(owner, DcpCheckpoint) and owner.args is not None:  # torch_dist
        carried = _materialize(owner.legacy_carried_state(), refs)
        args = args_for(owner.args, plan.spec, plan.target_layout)
        templates = owner.group_templates()
        optimizer_step = owner.view.optimizer_step if owner.view.has_optimizer else None
    else:  # no Megatron training state (HF, or an HF model's DCP): fresh args
        carried = {"checkpoint_version": 3.0, "iteration": plan.iteration or 0}
        args = args_for(args_from_spec(plan.spec), plan.spec, plan.target_layout)
        templates = owner.group_templates() if isinstance(owner, DcpCheckpoint) else {}
        optimizer_step = None
    return TrainingState(owner, template_path, carried, args, templates, optimizer_step, refs)


def _write_rank_file(plan: Plan, file: Any, source: Source, out: Any, assemble: Assembler) -> None:
    state = training_state(plan, file, source)  # type: ignore[arg-type]
    no_wd = {p.name: p.no_weight_decay for p in parameters(plan.spec)}
    entry = None
    if plan.target_layout.distributed_optimizer and state.optimizer_step is not None:
        kinds = [no_wd[t.canonical] for t in file.tensors]
        entry = distributed_optimizer_entry(
            kinds, state.templates, state.optimizer_step, state.carried
        )
    tree, slots = rank_tree(
        file,
        args=state.args,
        carried=state.carried,
        group_templates=state.templates,
        no_weight_decay=no_wd,
        optimizer_entry=entry,
    )
    writes = {slot.key: write for slot, write in zip(slots, file.tensors, strict=True)}
    carried_slots = state.carried_slots()

    def produce(slot: TensorSlot) -> Iterator[memoryview]:
        if slot.key in writes:
            yield from assemble.chunks(writes[slot.key], file.path)
        else:
            yield state.carried_bytes(slot)

    all_slots = [*slots, *carried_slots]
    with ReadAhead(all_slots, produce) as ahead:
        write_torch_zip(out, tree, all_slots, ahead)
