"""The writing side of a format: which files it writes for a source (pure, the planners' half,
``ckptctl.model.target``), which operations may target it, and which opened checkpoint it reads.

A format that can be written sets ``CheckpointFormat.target`` to a ``TargetFormat``; the CLI's
``--format`` choices, the pipeline's planning and the planners' strategies all go through it,
so adding a target format touches its own folder and the registry line only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ckptctl.errors import UsageError
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.plan import FileWrite, TextWrite
from ckptctl.model.stored import CheckpointView, unmapped_model
from ckptctl.model.target import TargetFiles, TargetPlanner, TargetRequest

if TYPE_CHECKING:
    from ckptctl.formats.base import Checkpoint

CONSOLIDATE = "consolidate"
RESHARD = "reshard"


class TargetFormat:
    """A format ckptctl writes. Subclasses set the class attributes and ``target_files``."""

    name: ClassVar[str]
    operations: ClassVar[tuple[str, ...]]
    """The commands that may write it (``consolidate``, ``reshard``)."""
    help: ClassVar[str]
    """One phrase for ``--format``'s help: what the target holds."""
    block_quantized: ClassVar[bool] = False
    """It writes linear weights in block-scaled FP8 when asked (``--dtype fp8-block``)."""
    cuts_by_name: ClassVar[bool] = False
    """It cuts the source's tensors by stored name, needing no model description."""
    meshed: ClassVar[bool] = False
    """It writes DTensors on a device mesh whose HSDP shard groups may be set
    (``TargetRequest.shard_group``, ``--fsdp-size``)."""
    moves_optimizer_state: ClassVar[bool] = True
    """It places optimizer state on the model's parameters, so a source whose state could not
    be placed (``Checkpoint.dp_reshardable``) is refused rather than written without it."""

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        raise NotImplementedError

    def with_source_state(
        self, source: CheckpointView, files: tuple[FileWrite, ...], layout: ParallelLayout
    ) -> tuple[tuple[FileWrite, ...], int]:
        return files, 0

    def stored_as_is(self, source: CheckpointView) -> tuple[TextWrite, ...] | None:
        return None

    def planner_for(self, ckpt: Checkpoint) -> tuple[Checkpoint, TargetPlanner]:
        """The checkpoint to read for this target (the opened one, or another view of it) and
        the planner of the files; raises ``UsageError`` for a source it cannot take."""
        return ckpt, self


def known_model(source: CheckpointView, target: str) -> ModelSpec:
    """The source's model, which a target named by model (HF, Megatron) needs."""
    if source.spec is None:
        raise UsageError(unmapped_model(source, target))
    return source.spec
