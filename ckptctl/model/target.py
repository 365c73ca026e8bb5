"""What a target format writes, as the planners see it. Pure.

A target format (``ckptctl.formats.<name>.target``) says which files it writes for a source and
a wanted layout, every tensor of each with its place in the canonical tensors (``TargetFiles``),
and the small text files written last. The planners fill those tensors from the source's pieces,
weigh strategies and cost them, and never ask which format they plan for: a new target format is
one folder and one registry line, not a branch here or in ``planners``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ckptctl.model.layout import ParallelLayout
from ckptctl.model.megatron_style import MegatronStyle
from ckptctl.model.plan import FileWrite, TextWrite
from ckptctl.model.stored import CheckpointView, StoredFile

FP8_BLOCK = "fp8-block"
"""``TargetRequest.dtype`` asking for linear weights in block-scaled FP8 (DeepSeek-V3's release
form), which only a target that says ``block_quantized`` writes."""


MXFP4 = "mxfp4"
"""``TargetRequest.dtype`` asking for GPT-OSS's expert weights in MXFP4 (OpenAI's release
form), which only a target that says ``block_quantized`` writes."""


@dataclass(frozen=True, slots=True)
class TargetRequest:
    """What the user asked of the target beyond its format."""

    layout: ParallelLayout | None = None
    """The wanted layout (``reshard``); ``None`` for a consolidation, whose format decides."""
    dtype: str | None = None
    """Weights converted to this dtype (or ``FP8_BLOCK``); ``None`` keeps the source's."""
    max_shard_bytes: int = 5 << 30
    """Largest file of a format that cuts its tensors into files by size (HF)."""
    style: MegatronStyle = field(default_factory=MegatronStyle)
    """How the source spells and orders a Megatron checkpoint, kept by Megatron targets."""
    shard_group: int | None = None
    """Ranks each parameter is sharded over in a target of DTensors on a device mesh (HSDP's
    shard group, verl's ``fsdp_size``; the world size: one flat mesh); ``None`` keeps the
    source's."""
    round_shifted: bool = False
    """Weights the target stores shifted (``StoredTensor.shift``) are rounded to their dtype
    where the shift is not exact, instead of refused (``--allow-rounding``)."""


@dataclass(frozen=True, slots=True)
class TargetFiles:
    """The files a target format writes for one source: every tensor with its canonical
    pieces, the kind of writer each file needs, and the text files written last."""

    files: tuple[StoredFile, ...]
    kind: str
    """``FileWrite.kind`` of every file (the registered writer that writes it)."""
    layout: ParallelLayout
    reason: str
    """Why the target looks as it does (a consolidation's plan says it)."""
    finalize: tuple[TextWrite, ...] = ()
    flat_kind: str | None = None
    """``FileWrite.kind`` of files that hold flat buffers (``StoredFile.flat``), if not ``kind``."""
    carries_rank_state: bool = False
    """Each file also carries what its source rank file holds beyond tensors (training state
    and the like, ``FileWrite.carry_from``) and the format's ``with_source_state`` adds what
    else of the source it keeps."""
    optimizer_carried: bool = True
    """Whether the target keeps the source's optimizer state (when it has some)."""
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


class TargetPlanner(Protocol):
    """The pure, planning half of a target format."""

    @property
    def name(self) -> str:
        """The format's name (``--format``, ``Plan.target_format``)."""
        ...

    @property
    def cuts_by_name(self) -> bool:
        """It cuts the source's tensors by stored name, needing no model description (verl
        at another world size), rather than by a model's layout rules."""
        ...

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        """The files this format writes for ``source``; raises ``UsageError`` for a request it
        cannot serve and ``LayoutError`` for a layout it cannot hold."""
        ...

    def with_source_state(
        self, source: CheckpointView, files: tuple[FileWrite, ...], layout: ParallelLayout
    ) -> tuple[tuple[FileWrite, ...], int]:
        """``files`` (planned from ``target_files``) with what else of the source the format
        keeps beyond the canonical tensors, and the bytes that reads."""
        ...

    def stored_as_is(self, source: CheckpointView) -> tuple[TextWrite, ...] | None:
        """The text files that make ``source``'s own files, copied byte for byte, a complete
        checkpoint of this format (the ``direct`` strategy), or ``None`` when they cannot."""
        ...
