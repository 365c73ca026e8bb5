"""The executor: carry out a ``Plan``, one tensor at a time, and commit by writing markers last.

Memory holds one target tensor (plus the source box being copied into it) at a time: each target
file is streamed (safetensors header or torch pickle first, then tensor bytes in order), so peak
memory follows the largest tensor, not the checkpoint.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ckptctl.catalog import parameters
from ckptctl.formats.hf import write_safetensors
from ckptctl.formats.megatron import MegatronCheckpoint, args_for, carried_state, rank_tree
from ckptctl.formats.torchzip import TensorRef, TensorSlot, tensor_bytes, write_torch_zip
from ckptctl.plan import FileKind, Plan, TensorWrite
from ckptctl.storage import Storage


class Source(Protocol):
    def read(
        self,
        path: str,
        key: tuple[str | int, ...],
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
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
    bytes_written: int = 0
    files_written: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_bytes: int = 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Assembler:
    def __init__(self, plan: Plan, source: Source, report: Report, progress: Progress) -> None:
        self.plan, self.source, self.report, self.progress = plan, source, report, progress

    def tensor(self, write: TensorWrite) -> torch.Tensor:
        dtype = getattr(torch, write.dtype)
        out = (torch.zeros if write.padding else torch.empty)(write.shape, dtype=dtype)
        for copy in write.copies:
            data = self.source.read(
                self.plan.source_files[copy.source], copy.key, copy.src, copy.sizes
            )
            self.report.bytes_read += data.numel() * data.element_size()
            box = tuple(slice(o, o + n) for o, n in zip(copy.dst, copy.sizes, strict=True))
            out[box] = data.to(dtype)
        return out

    def chunks(self, write: TensorWrite) -> Iterator[memoryview]:
        data = self.tensor(write)
        view = tensor_bytes(data)
        self.report.bytes_written += len(view)
        self.progress.advance(len(view))
        yield view


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


def execute(
    plan: Plan, source: Source, target: Storage, progress: Progress | None = None
) -> Report:
    """Write every file of ``plan`` to ``target``, then its finalize files in order."""
    progress = progress or NoProgress()
    report = Report()
    started = time.perf_counter()
    total = sum(
        t.dtype and torch.Size(t.shape).numel() * getattr(torch, t.dtype).itemsize
        for f in plan.files
        for t in f.tensors
    )
    progress.start(total, f"{plan.operation} -> {plan.target_url}")
    assemble = _Assembler(plan, source, report, progress)
    for file in plan.files:
        with target.open_write(file.path) as out:
            if file.kind is FileKind.SAFETENSORS:
                entries = [(str(t.key[0]), t.dtype, t.shape) for t in file.tensors]
                write_safetensors(out, entries, lambda i, f=file: assemble.chunks(f.tensors[i]))
            else:
                _write_rank_file(plan, file, source, out, assemble)
        report.files_written.append(file.path)
    for text in plan.finalize:
        target.write_text(text.path, text.content)
        report.files_written.append(text.path)
    progress.finish()
    report.seconds = time.perf_counter() - started
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def _write_rank_file(plan: Plan, file: Any, source: Source, out: Any, assemble: _Assembler) -> None:
    if not isinstance(source, MegatronCheckpoint):
        raise NotImplementedError("Megatron targets from non-Megatron sources")
    template_path = plan.source_files[file.carry_from or 0]
    refs: list[TensorRef] = []
    carried = _materialize(carried_state(source.tree(template_path)), refs)
    no_wd = {p.name: p.no_weight_decay for p in parameters(plan.spec)}
    tree, slots = rank_tree(
        file,
        args=args_for(source.args, plan.spec, plan.target_layout),
        carried=carried,
        group_templates=source.group_templates,
        no_weight_decay=no_wd,
    )
    writes = {slot.key: write for slot, write in zip(slots, file.tensors, strict=True)}
    carried_slots = [TensorSlot(f"carried{i}", r.dtype, r.shape) for i, r in enumerate(refs)]

    def produce(slot: TensorSlot) -> Iterator[memoryview]:
        if slot.key in writes:
            yield from assemble.chunks(writes[slot.key])
        else:
            data = source.read_ref(template_path, refs[int(slot.key.removeprefix("carried"))])
            yield tensor_bytes(data)

    write_torch_zip(out, tree, [*slots, *carried_slots], produce)
