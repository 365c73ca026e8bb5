"""What a checkpoint holds, as the planners see it: files of tensors, each mapped onto canonical
tensors by geometry pieces. Pure values, produced by format modules and consumed by planners.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ckptctl.model.geometry import Piece, Shape
from ckptctl.model.hf_named import HfNamedSource
from ckptctl.model.layout import ModelSpec, ParallelLayout

KeyPath = tuple[str | int, ...]
FlatView = tuple[int, Shape] | None
"""``(offset, shape)``: a tensor viewed as a slice of a flat stored tensor (``distrib_optim.pt``
buffers, layer-stacked records), or ``None`` for the stored tensor itself."""


class Format(StrEnum):
    MEGATRON = "megatron"
    HF = "hf"
    TORCH_DIST = "torch_dist"
    """Megatron-Core's DCP-based format: ``metadata.json``, ``common.pt``, ``.metadata``."""
    DCP = "dcp"
    """Any other PyTorch Distributed Checkpoint: keys are not a known model's."""
    TORCH = "torch"
    """One ``torch.save`` file of the whole state dict (as ``dcp_to_torch_save`` writes)."""
    DEEPSPEED = "deepspeed"
    """DeepSpeed ZeRO: ``latest``, ``<tag>/*_model_states.pt`` and ``*_optim_states.pt``."""
    DEEPSPEED_UNIVERSAL = "deepspeed-universal"
    """DeepSpeed's universal checkpoint: ``latest_universal``, ``<tag>/zero/<param>/<state>.pt``."""


# Not declared frozen only because a frozen dataclass takes 2.5 times as long to build (a
# trillion-parameter checkpoint's view holds 400,000 of them): it is immutable all the same,
# and shared (every expert-parallel file of a dense shard holds the same objects), so never
# change one: make another with ``dataclasses.replace``.
@dataclass(slots=True)
class StoredTensor:
    key: KeyPath
    """Where the tensor sits in its file: a path of dict keys / list indices, or a tensor name."""
    canonical: str
    """The canonical tensor it holds part of (see ``ckptctl.model.catalog``)."""
    shape: Shape
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``bfloat16``."""
    pieces: tuple[Piece, ...]
    view_offset: int | None = None
    """Set when the tensor is a slice of a flat stored tensor (``distrib_optim.pt``): its
    elements start here in the flat tensor at ``key`` and are viewed with ``shape``."""
    transposed: bool = False
    """Stored as the transpose of ``shape`` (2-D): ``shape`` and ``pieces`` are in the
    canonical tensor's orientation, the bytes are not (megatron-core's ``GroupedMLP``)."""
    base_shape: Shape | None = None
    """Shape of the stored tensor at ``key`` when this one is a block of it that is not a flat
    buffer of the file (``GroupedMLP``'s ``weight1``: one block per local expert)."""
    padded_origin: Shape | None = None
    """Where a box of a vocabulary tensor's state that holds Megatron's padding rows lies in the
    padded tensor (global rows and columns), when its key cannot say (a flat buffer's cut of
    it): its pieces leave the padding out, and a plan's writes keep no pieces."""

    interleaved: bool = False
    """Dim 0 (in ``shape``'s orientation) holds the two halves of a gated tensor interleaved:
    stored row 2j is the canonical first half's row j, 2j + 1 the second half's (GPT-OSS's
    ``gate_up_proj``)."""
    shift: float = 0.0
    """Stored as the canonical values plus ``shift`` (Qwen3.5's gated norm holds ``1 + w``
    where Megatron's zero-centred norm holds ``w``): applied exactly both ways, or refused."""
    shift_rounds: bool = False
    """Written shifted and rounded to ``dtype`` where the sum is no ``dtype`` number, instead
    of refused (``--allow-rounding``): each tensor's largest error goes to the manifest."""

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def block_shape(self) -> Shape:
        """Shape of the tensor's own elements as they lie in storage."""
        return self.shape[::-1] if self.transposed else self.shape

    @property
    def stored_shape(self) -> Shape:
        """Shape of the stored tensor at ``key``."""
        return self.base_shape or self.block_shape


@dataclass(frozen=True, slots=True)
class StoredFile:
    path: str
    """Relative to the checkpoint root, ``/``-separated."""
    tensors: tuple[StoredTensor, ...]
    rank: tuple[int, int] | None = None
    """(tp rank, pp rank) for Megatron rank files."""
    flat: tuple[tuple[KeyPath, int], ...] = ()
    """Flat tensors (key, length) that ``view_offset`` tensors are slices of; gaps are zeros."""
    ep_rank: int = 0
    """Expert-parallel rank of a Megatron rank file (0 without expert parallelism)."""
    buckets: tuple[tuple[KeyPath, tuple[int, ...]], ...] = ()
    """Per flat tensor of a distributed-optimizer file: the unpadded sizes of the grad-buffer
    buckets it concatenates (``distopt_layout``)."""
    mesh: tuple[int, ...] = ()
    """The device mesh a file of DTensors is written for, ranks per dimension: ``(world,)``,
    or HSDP's ``(replicas, shard group)``; empty for a format without one."""


@dataclass(frozen=True, slots=True)
class Replica:
    """A stored tensor a format keeps as a copy of another (DeepSeek's MTP layers keep copies
    of the embedding and the output layer): conversions read the original, and check that the
    copy holds the same bytes before their output counts as complete."""

    path: str
    key: KeyPath
    shape: Shape
    copy_path: str
    copy_key: KeyPath
    why: str = ""
    """What makes the copy differ when it does, and what to do (the default says the model
    shares one tensor there)."""


@dataclass(frozen=True, slots=True)
class CheckpointView:
    """A whole checkpoint as files of canonical pieces, plus what produced it."""

    format: Format | str
    """A built-in ``Format``, or the name of a format registered from outside."""
    spec: ModelSpec | None
    """``None`` when the model family is unknown (a generic DCP checkpoint)."""
    layout: ParallelLayout
    files: tuple[StoredFile, ...]
    iteration: int | None = None
    has_optimizer: bool = False
    notes: tuple[str, ...] = field(default=())
    optimizer_step: float | None = None
    """Adam's step when it is kept per parameter group (distributed optimizer), not per tensor."""
    frozen: tuple[str, ...] = ()
    """Canonical tensors holding frozen parameters (DeepSpeed): their optimizer state is
    absent, in part or whole."""
    weights_are_masters: bool = False
    """The weights held are the optimizer's fp32 masters (DeepSpeed): a mixed-precision
    target's ``fp32_param`` copies them."""
    warnings: tuple[str, ...] = ()
    """What a conversion of this checkpoint cannot carry (``notes`` say the rest)."""
    replicas: tuple[Replica, ...] = ()
    """Stored copies of stored tensors, not part of any canonical tensor (``Replica``)."""
    hf_named: HfNamedSource | None = None
    """An HF model known by its names only (no family table): canonical tensors are its
    tensors by hub name, written to HF safetensors as they are with the config carried."""

    def canonical_dtypes(self) -> dict[str, str]:
        return {t.canonical: t.dtype for f in self.files for t in f.tensors}


def unmapped_model(view: CheckpointView, target: str) -> str:
    """Why a source without a model description cannot become ``target`` (a Megatron layout,
    a family-mapped HF model), and what it can become."""
    if view.hf_named is not None:
        why = next((n for n in view.notes if n.startswith("not convertible")), "")
        return (
            f"the source is an HF {view.hf_named.model.architecture} known by its tensor names "
            f"only ({why or 'no family table'}): it cannot become {target}; consolidate it to "
            "HF safetensors (--format hf) or one torch file (--format torch)"
        )
    return (
        f"the source's model family is unknown (keys are not Megatron-Core's or HF's with a "
        f"config.json): it cannot become {target}; consolidate it with --format torch"
        + "".join(f" ({n})" for n in view.notes if "--hf-config" in n)
    )


def canonical_shapes(view: CheckpointView) -> dict[str, tuple[Shape, str]]:
    """Each canonical tensor's shape (the bounding box of its pieces) and dtype: for formats
    whose model family is unknown, this is all there is to know about the full tensors."""
    out: dict[str, tuple[Shape, str]] = {}
    for file in view.files:
        for tensor in file.tensors:
            shape, _ = out.get(tensor.canonical, ((0,) * len(tensor.shape), tensor.dtype))
            for piece in tensor.pieces:
                ends = tuple(c + n for c, n in zip(piece.canonical, piece.sizes, strict=True))
                shape = tuple(max(a, b) for a, b in zip(shape, ends, strict=True))
            out[tensor.canonical] = (shape, tensor.dtype)
    return out
