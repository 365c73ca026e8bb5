"""The one interface every checkpoint format implements.

A format is one folder under ``ckptctl/formats/`` holding its pure layout (what planners see),
its reader and its writer, and exporting ``FORMAT``: a ``CheckpointFormat`` listed once in
``registry.py`` (or added with ``registry.register``). Probing asks each registered format in
turn whether it recognises what is stored; the executor asks the format that owns a file kind
for its writer; ``verify`` asks the source's format which checksums its files carry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ckptctl.checksums.integrity import Targets, whole_file_entries
from ckptctl.errors import CheckpointError
from ckptctl.formats.options import FormatOption
from ckptctl.formats.support import FormatSupport
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.storage import Storage
from ckptctl.model.peft_wrapped import EmbeddedLora
from ckptctl.model.plan import FileWrite, Plan
from ckptctl.model.stored import CheckpointView, FlatView, KeyPath, Shape

if TYPE_CHECKING:
    import numpy as np

    from ckptctl.formats.target import TargetFormat
    from ckptctl.io.runs import Span
    from ckptctl.model.megatron_style import MegatronStyle
    from ckptctl.pipeline.assembler import Assembler
    from ckptctl.pipeline.job_report import Report, Sources

T = TypeVar("T")


class Checkpoint:
    """An opened checkpoint: what it holds (``view``), a reader of boxes of its tensors, and
    every other capability the pipeline asks of a format, each declared here with the answer
    of a format that lacks it. A format's reader subclasses this class and overrides what it
    can do; nothing outside asks a reader whether it has an attribute."""

    storage: Storage
    view: CheckpointView
    reads_into: ClassVar[bool] = False
    """``read`` can put a box's bytes straight into a given array (``into``)."""
    locates: ClassVar[bool] = False
    """``where`` answers for this format's boxes (byte ranges of its files)."""
    lost: frozenset[str] = frozenset()
    """Files absent from storage, opened with ``allow_missing`` (recovered from copies)."""
    adapter: EmbeddedLora | None = None
    """A LoRA adapter trained inside the checkpoint (a PEFT model's state dict: ``view`` is
    then its base model): ``merge-lora`` merges or exports it; other jobs refuse such a
    checkpoint rather than drop it."""

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: Shape,
        sizes: Shape,
        view: FlatView = None,
        *,
        transposed: bool = False,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        """Box ``[offsets, offsets + sizes)`` of the tensor at ``key`` (or of its ``view``), as
        a numpy array of the dtype ``ckptctl.arrays.numpy_dtype`` maps the stored one to
        (little-endian; bfloat16 and float8 as the named words it defines). Jobs move these
        arrays without importing torch.

        A format whose view declares ``StoredTensor.transposed`` tensors also takes
        ``transposed=True`` for them: the box is then in the canonical orientation. A format
        that ``reads_into`` may fill ``into`` and return it."""
        raise NotImplementedError(f"{type(self).__name__} reads no tensors")

    def where(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        """Where the box lies in the files, when it lies contiguously (``None``: unknown)."""
        return None

    def extent(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        """The bytes a read of the box touches, contiguous or not (by default: ``where``)."""
        return self.where(path, key, offsets, sizes, view)

    def record_windows(self, path: str) -> list[tuple[int, int]] | None:
        """``(offset, length)`` of each zip archive within file ``path`` when the file holds
        several (DCP records); ``None``: the file is one archive or none."""
        return None

    @property
    def dp_reshardable(self) -> bool:
        """Whether the optimizer state is Megatron's ``dp_reshardable`` buckets that could not
        be placed on parameters (such state cannot move)."""
        return False

    @property
    def style(self) -> MegatronStyle | None:
        """Spelling, layer order and optimizer form to keep when writing Megatron files."""
        return None

    def saved_training(self, path: str) -> SavedTraining | None:
        """Training state file ``path`` keeps besides tensors, for writers that carry it on."""
        return None

    def as_generic(self) -> Checkpoint | None:
        """The checkpoint as named tensors, every stored key whatever model it holds (DCP)."""
        return None

    def state_dict_items(self) -> list[tuple[KeyPath, Any, Any]] | None:
        """Non-tensor entries of an HF torch state dict (Adam's step, parameter groups), for a
        checkpoint of an HF model trained under another framework; ``None`` otherwise."""
        return None

    def state_dict_aliases(self) -> dict[KeyPath, KeyPath]:
        """Tied parameters, by their key path in that state dict."""
        return {}

    def key_path(self, name: str) -> KeyPath:
        """The nested key path of a stored name in a torch state dict."""
        return (name,)

    def byte_items(self) -> list[str]:
        """Names of stored non-tensor items a torch state dict carries on."""
        return []

    def byte_item(self, name: str) -> tuple[Any, Any]:
        """One of ``byte_items``: its value and the reader of the tensors inside it."""
        raise KeyError(f"{self.storage.url} stores no non-tensor item {name!r}")

    def read_ref(self, path: str, ref: Any) -> Any:
        """A tensor that file ``path``'s carried training state refers to (``saved_training``),
        read: formats that carry such state answer."""
        raise NotImplementedError(f"{type(self).__name__} carries no training state's tensors")

    def param_groups(self) -> list[dict[str, Any]] | None:
        """The optimizer's parameter groups by HF name, when the source keeps them so."""
        return None

    def universal_model_state(self) -> dict[str, Any]:
        """Model-state entries a DeepSpeed universal checkpoint carries on."""
        return {}

    def quantization_errors(self) -> dict[str, float]:
        """Largest error of each tensor written lossily (FP8 blocks ckptctl wrote, by their
        canonical names): what ``verify --against`` judges them by."""
        return {}

    def with_weights(self, weights: Checkpoint, directory: str) -> Checkpoint:
        """This checkpoint, which holds state saved apart from its weights, joined with the
        weights ``weights`` holds in its ``directory`` (``WeightsElsewhere.rest``)."""
        raise NotImplementedError(f"{type(self).__name__} joins no weights")

    def rounding_errors(self) -> dict[str, float]:
        """Largest error so far of each canonical tensor the reads rounded, by name (HF's
        shifted weights under ``--allow-rounding``): what the output's manifest records."""
        return {}


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeRequest:
    """What the caller asked for when opening a checkpoint: how it is named and what the job
    does with it, and the format options the user gave (each format reads those it declares in
    ``CheckpointFormat.options``)."""

    file: str | None = None
    """The URL named this one file under the storage root, not a directory."""
    allow_missing: bool = False
    """Open a sharded checkpoint with rank files missing (they are recovered from copies)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The options given, by ``FormatOption.name`` (those not given are absent)."""

    def get(self, option: FormatOption[T]) -> T:
        """``option``'s value, or its default when it was not given."""
        value: T = self.options.get(option.name, option.default)
        return value


class WeightsElsewhere(CheckpointError):
    """Raised by a probe whose checkpoint keeps its weights in a directory of another format
    (verl's Megatron actors saved through a bridge: HF safetensors in one directory, the
    optimizer's ``torch_dist`` shards in another). The opener reads ``directory`` (relative to
    the checkpoint) and joins what it holds with ``rest`` when there is one, ``warnings`` saying
    what is not carried; a caller that does not follow it reports the message."""

    def __init__(
        self,
        message: str,
        *,
        directory: str,
        warnings: tuple[str, ...],
        iteration: int | None,
        rest: Checkpoint | None = None,
    ) -> None:
        super().__init__(message)
        self.directory = directory
        self.warnings = warnings
        self.iteration = iteration
        self.rest = rest
        """What the checkpoint holds beside the weights (optimizer state), opened: the
        opener joins the weights with it (``Checkpoint.with_weights``)."""


@dataclass(frozen=True)
class SavedTraining:
    """Training state a checkpoint keeps besides tensors, for writers that carry it on."""

    carried: Any = None
    """Counters, scheduler, ... (may hold tensor references, copied as they are)."""
    args: Any = None
    """Megatron's ``argparse.Namespace``, when the source has one."""
    templates: Mapping[bool, Mapping[str, Any]] = field(default_factory=dict)
    """Optimizer parameter-group settings by kind (True: no weight decay)."""
    optimizer_step: float | None = None
    rng_state: Any = None
    """The rank's RNG state as a Megatron rank file keeps it (``rng_state``): carried only to
    the same rank of an unchanged grid (``FileWrite.carry_rng``)."""


def adam_step(owner: Checkpoint) -> float | None:
    """Adam's step count of ``owner``'s optimizer state: as its format records it for the
    parameter groups, else its first per-parameter ``step`` tensor (torch's Adam keeps one per
    parameter, all equal: FSDP's, torchtitan's and the HF Trainer's state)."""
    if owner.view.optimizer_step is not None:
        return float(owner.view.optimizer_step)
    for file in owner.view.files:
        for t in file.tensors:
            if t.canonical.startswith("step/"):
                view = None if t.view_offset is None else (t.view_offset, t.shape)
                zero = (0,) * len(t.shape)
                from ckptctl.arrays import first_value  # numpy: only when bytes are handled

                return float(first_value(owner.read(file.path, t.key, zero, t.shape, view)))
    return None


@dataclass(frozen=True)
class WriteJob:
    """What a writer is handed for each target file."""

    plan: Plan
    source: Sources
    assemble: Assembler
    report: Report


Writer = Callable[[WriteJob, FileWrite, ByteStream], None]
"""Writes one target file of the plan into ``out`` (a forward-only stream)."""


def lazy(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported on first call: readers and writers import torch, and a
    registry entry must not (``ckptctl formats`` and ``--help`` touch no tensor)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = name
    return call


@dataclass(frozen=True)
class CheckpointFormat:
    """One format: how it is recognised and opened, and (if it is a target) how it is written.

    ``probe`` returns ``None`` for storage that is not in this format; an error for storage
    that is this format but broken. Formats are asked in registry order."""

    name: str
    probe: Callable[[Storage, frozenset[str], ProbeRequest], Checkpoint | None]
    support: FormatSupport | None = None
    writers: Mapping[str, Writer] = field(default_factory=dict)
    """File kind (``FileWrite.kind``) -> the function writing such a file."""
    finish: Callable[[WriteJob], list[tuple[str, bytes]]] | None = None
    """Files written after every data file (e.g. ``torch_dist``'s ``.metadata``)."""
    finish_paths: Callable[[Plan], tuple[str, ...]] | None = None
    """The paths ``finish`` writes, known before the job starts."""
    description_files: Callable[[Storage, CheckpointView], list[str]] | None = None
    """Files besides tensor files that say what the checkpoint is (saved-plan fingerprints)."""
    target: TargetFormat | None = None
    """How the format is planned as a target (``None``: ckptctl only reads it)."""
    options: tuple[FormatOption[Any], ...] = ()
    """The options of the request it reads (``ProbeRequest.get``); an option it does not list
    is refused when no other source of the job reads it."""
    integrity: Callable[[Any], Targets] | None = None
    """Which checksums the files of an opened checkpoint carry (default: every tensor file is
    a ``torch.save`` archive with a CRC-32 per entry)."""

    def checksums(self, ckpt: Checkpoint) -> Targets:
        if self.integrity is not None:
            return self.integrity(ckpt)
        return Targets(
            zips={f.path: whole_file_entries(ckpt.storage, f.path) for f in ckpt.view.files}
        )

    def metadata_files(self, storage: Storage, view: CheckpointView) -> list[str]:
        return self.description_files(storage, view) if self.description_files else []


def templates_of(groups: list[dict[str, Any]]) -> dict[bool, dict[str, Any]]:
    """Parameter groups' settings by kind (True: no weight decay), without their parameters
    and Adam's step."""
    out: dict[bool, dict[str, Any]] = {}
    for group in groups:
        no_decay = float(group.get("wd_mult", 1.0)) == 0.0 or group.get("weight_decay") == 0
        out[no_decay] = {k: v for k, v in group.items() if k not in ("params", "step")}
    return out
