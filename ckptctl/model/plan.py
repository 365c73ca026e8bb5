"""The plan schema: a value recording what to read and write, why, and at what estimated cost.

Pure and versioned. A plan names the source it was made for (with a fingerprint of what was
stored), every target file with every tensor and the source boxes that fill it, the small text
files written last (the last one is the commit marker), and its estimates. Execution takes only
a plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from ckptctl.errors import LayoutError
from ckptctl.model.geometry import boxes_disjoint, nbytes
from ckptctl.model.layout import ModelSpec, ParallelLayout

PLAN_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


COPY = "copy"
"""``FileWrite.kind`` of a byte-for-byte copy of a source file (the direct strategy); every other
kind names the registered format writer that writes the file (``CheckpointFormat.writers``)."""


# Copy operations and tensor writes number in the hundred thousands for large models (700,000
# for a trillion-parameter checkpoint with Adam state), so they are plain dataclasses, cheap to
# build; pydantic still validates and serialises them as fields of the Plan. They are not
# declared frozen only because a frozen dataclass takes 2.5 times as long to build (0.6 s of
# such a plan): they are immutable all the same, and shared (one dense tensor's write by every
# expert-parallel file that holds it), so never change one: make another with
# ``dataclasses.replace``. Build them with keywords, except in the planner's hot loop, where
# positional arguments save a third of the time (their order is the fields' order).
@dataclass(slots=True)
class CopyOp:
    source: int
    """Index into ``Plan.source_files``."""
    key: tuple[str | int, ...]
    src: tuple[int, ...]
    dst: tuple[int, ...]
    sizes: tuple[int, ...]
    view: tuple[int, tuple[int, ...]] | None = None
    """(offset, shape) when the source tensor is a slice of a flat stored tensor."""
    transposed: bool = False
    """The source tensor is stored transposed (``StoredTensor.transposed``)."""


@dataclass(slots=True)
class TensorWrite:
    key: tuple[str | int, ...]
    canonical: str
    shape: tuple[int, ...]
    dtype: str
    copies: tuple[CopyOp, ...]
    padding: int = 0
    """Elements no source covers (vocabulary padding rows): written as ``fill``."""
    fill: float = 0.0
    view_offset: int | None = None
    """Set when this tensor is a slice of a flat target tensor (``distrib_optim.pt``)."""
    transposed: bool = False
    """Written as the transpose of ``shape`` (``StoredTensor.transposed``)."""
    base_shape: tuple[int, ...] | None = None
    """Shape of the stored tensor this one is a block of (``StoredTensor.base_shape``)."""
    padded_origin: tuple[int, ...] | None = None
    """Where a box holding padding rows lies (``StoredTensor.padded_origin``)."""
    interleaved: bool = False
    """Written with dim 0's gated halves interleaved (``StoredTensor.interleaved``)."""
    shift: float = 0.0
    """Written as the canonical values plus this (``StoredTensor.shift``)."""
    shift_rounds: bool = False
    """The shift rounded where it is not exact (``StoredTensor.shift_rounds``)."""


class FileWrite(_Frozen):
    path: str
    kind: str
    tensors: tuple[TensorWrite, ...]
    rank: tuple[int, int] | None = None
    ep_rank: int = 0
    """Expert-parallel rank of a Megatron or ``torch_dist`` target file."""
    carry_from: int | None = None
    """Source file whose training state (scheduler, counters) this file carries."""
    carry_rng: bool = False
    """Carry ``carry_from``'s RNG state too: it is the same rank of an unchanged TP/PP/EP grid
    (``formats.megatron_common.rank_state``)."""
    flat: tuple[tuple[tuple[str | int, ...], int], ...] = ()
    """Flat tensors (key, length) that ``view_offset`` tensors are slices of."""
    copy_of: int | None = None
    """For a ``COPY``: the source file copied as it is."""
    mesh: tuple[int, ...] = ()
    """The device mesh of a file of DTensors (``StoredFile.mesh``)."""


class TextWrite(_Frozen):
    path: str
    content: str


class Estimates(_Frozen):
    bytes_read: int
    bytes_written: int
    read_requests: int
    peak_memory_bytes: int
    """Largest tensor assembled at once, plus the largest single read."""
    write_requests: int = 0
    seconds: float = 0.0
    """Time by the storage cost model (``planners.cost``)."""
    pipeline_seconds: float = 0.0
    """The part of ``seconds`` that fills and drains the pipeline between reads and writes:
    each process of a job split over nodes pays it whole."""


class Alternative(_Frozen):
    """A strategy the planner weighed: its estimates, or why it cannot be used."""

    strategy: str
    estimates: Estimates | None = None
    refused: str | None = None


class SourceRef(_Frozen):
    """A further checkpoint of the same training state (e.g. a full copy in the data lake)
    whose files appear in ``Plan.source_files`` under ``prefix``."""

    prefix: str
    url: str
    format: str
    fingerprint: str


class Plan(_Frozen):
    version: int = PLAN_VERSION
    operation: str
    strategy: str
    reason: str
    source_url: str
    source_format: str
    """The registered format's name (``Format`` for the built-in ones)."""
    source_fingerprint: str
    source_files: tuple[str, ...]
    spec: ModelSpec | None
    """``None`` for a model family ckptctl does not know (generic DCP to one torch file)."""
    source_layout: ParallelLayout
    source_mesh: tuple[int, ...] = ()
    """The device mesh the source's DTensors were written on (``StoredFile.mesh``); ``()``
    for a source without one."""
    target_url: str
    target_format: str
    """The registered target format's name."""
    target_layout: ParallelLayout
    iteration: int | None = None
    files: tuple[FileWrite, ...]
    finalize: tuple[TextWrite, ...]
    estimates: Estimates
    notes: tuple[str, ...] = ()
    """What the user may want to know (printed as ``note:``)."""
    warnings: tuple[str, ...] = ()
    """What may be wrong for the user's purpose: state not carried, or dropped (``warning:``)."""
    alternatives: tuple[Alternative, ...] = ()
    extra_sources: tuple[SourceRef, ...] = ()
    read_workers: int = 1
    """Source ranges fetched in parallel (reads spread over several stored copies)."""
    source_identities: tuple[tuple[str, str], ...] = ()
    """Each source file the plan depends on, with what identifies its content (size and times
    locally, ETag on object stores): a saved plan names the file that changed since."""

    def model(self) -> ModelSpec:
        """The model spec of a plan whose target needs one (Megatron, ``torch_dist``, HF):
        the planners make such plans only from a model ckptctl knows."""
        if self.spec is None:
            raise LayoutError(
                f"a {self.target_format} target needs a model ckptctl knows, and the "
                f"plan for {self.source_url} has none"
            )
        return self.spec

    def fingerprint(self) -> str:
        """A stable hash of the plan's content, so reruns can tell an output of this very plan
        (each source file known by its full identity: on a local disk, inode and change time
        too, which no copy or hand-set time reproduces).

        A job asks for it several times (destination, manifest) and a trillion-parameter plan
        takes a second to hash: the last plan's hashes are remembered, by identity (the plan is
        frozen; a changed copy is another object)."""
        return self._fingerprints()[0]

    def shared_fingerprint(self) -> str:
        """What the processes of one job must agree on before writing: the plan, each local
        source file known only by what a faithful copy keeps (size and modification time:
        nodes may read one checkpoint from copies of their own, whose inodes and change times
        differ); object-store identities (ETag, version) as they are."""
        return self._fingerprints()[1]

    def _fingerprints(self) -> tuple[str, str]:
        global _last_fingerprints
        last = _last_fingerprints
        if last is not None and last[0] is self:
            return last[1]
        content = hashlib.sha256()
        for part in self.json_parts(identities=False):
            content.update(part.encode())

        def with_identities(identities: list[Any]) -> str:
            digest = content.copy()
            digest.update(json.dumps(identities).encode())
            return digest.hexdigest()[:16]

        # The source's fingerprint hashes its files' full identities too: the shared one has
        # the files' copy-kept identities instead.
        full = [(path, identity) for path, identity in self.source_identities]
        shared = [(path, _as_copies_keep(identity)) for path, identity in full]
        value = (with_identities([self.source_fingerprint, full]), with_identities(shared))
        _last_fingerprints = (self, value)
        return value

    def json_parts(
        self, extra: dict[str, Any] | None = None, *, identities: bool = True
    ) -> Iterator[str]:
        """The plan as one JSON document (with ``extra``'s keys beside the plan's; without what
        identifies the very source files if not ``identities``), given a file at a time, one
        file per line: a trillion-parameter plan is hundreds of MB of JSON, written and hashed
        without ever being held whole."""
        own = {"source_identities", "source_fingerprint"}  # of these very source files
        head = self.model_dump_json(exclude={"files"} if identities else {"files", *own})
        more = json.dumps(extra, default=str)[1:-1] + "," if extra else ""
        yield f'{head[:-1]},{more}"files":['
        for position, file in enumerate(self.files):
            yield ("," if position else "") + "\n" + file.model_dump_json()
        yield "\n]}\n"


_last_fingerprints: tuple[Plan, tuple[str, str]] | None = None

HOST_ONLY = ("ctime=", "ino=")
"""Parts of a local file's identity (``Storage.identity``: ``size= mtime= ctime= ino=``) that
only the host holding that very file has: a copy elsewhere keeps size and modification time."""


def _as_copies_keep(identity: str) -> str:
    return " ".join(part for part in identity.split() if not part.startswith(HOST_ONLY))


def smallest_band(plan: Plan) -> tuple[int, str]:
    """The least tensor data a job must hold at once to write ``plan``: one row (along the
    first dimension, in which tensors stream) of its widest tensor, and that tensor's name. A
    memory budget below it cannot be kept."""
    most, name = 0, ""
    for file in plan.files:
        for tensor in file.tensors:
            row = nbytes(tensor.shape[1:], tensor.dtype)  # a scalar's row is itself
            if row > most:
                most, name = row, tensor.canonical
    return most, name


def coverage_problems(plan: Plan) -> list[str]:
    """Every target element written exactly once: copies in bounds, not overlapping, and with
    the padding adding up to the tensor. Empty when the plan is sound."""
    problems = []
    for file in plan.files:
        for tensor in file.tensors:
            where = f"{file.path}:{'.'.join(map(str, tensor.key))}"
            boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
            covered = 0
            for copy in tensor.copies:
                if any(
                    o < 0 or o + n > m
                    for o, n, m in zip(copy.dst, copy.sizes, tensor.shape, strict=True)
                ):
                    problems.append(f"{where}: copy to {copy.dst}+{copy.sizes} out of bounds")
                box = (copy.dst, copy.sizes)
                if any(not boxes_disjoint(box, other) for other in boxes):
                    problems.append(f"{where}: copies overlap at {copy.dst}")
                boxes.append(box)
                n = 1
                for size in copy.sizes:
                    n *= size
                covered += n
            numel = 1
            for size in tensor.shape:
                numel *= size
            if covered + tensor.padding != numel:
                problems.append(
                    f"{where}: {covered} elements copied + {tensor.padding} padding != {numel}"
                )
    return problems
