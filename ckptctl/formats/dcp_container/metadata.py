"""PyTorch DCP ``.metadata`` as our own frozen records (``DcpMetadata``): what it holds, with
the constraints each record must meet. ``parse`` reads a ``.metadata`` file into them safely,
``checks`` verifies what they promise, ``write`` writes them back. Pure: no I/O, no torch.

"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

from ckptctl.model.dtypes import DTYPES
from ckptctl.model.geometry import Shape

METADATA_FILE = ".metadata"
DCP_VERSION = "1.0.0"
"""``Metadata.version`` torch 2.13's ``FileSystemWriter`` writes."""

KeyPath = tuple[str | int, ...]
StorageKey = tuple[str, Shape | None]
"""``(fqn, chunk offsets)`` of a tensor chunk's record, ``(fqn, None)`` of a byte item's."""

SUPPORTED_TRANSFORMS: frozenset[str] = frozenset()
"""Stream transforms (``_StorageInfo.transform_descriptors``) ckptctl can undo: none yet. The
only one torch ships is ``stream.zstd/1`` (``FileSystemWriter(_extensions=[ZStandard()])``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """One stored box of a tensor, in global coordinates."""

    offsets: Shape
    """Element offset of the box in each dimension of the global tensor."""
    sizes: Shape
    """Extent of the box in each dimension (the shape of the stored record)."""

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"chunk offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if any(v < 0 for v in (*self.offsets, *self.sizes)):
            raise ValueError(f"chunk offsets {self.offsets} / sizes {self.sizes} are negative")

    @property
    def numel(self) -> int:
        return prod(self.sizes)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """A tensor of the checkpoint: its global geometry and the chunks that store it."""

    dtype: str
    """torch dtype name without the ``torch.`` prefix (``"bfloat16"``)."""
    shape: Shape
    """Global shape."""
    chunks: tuple[Chunk, ...]
    """Stored boxes; a valid checkpoint tiles ``shape`` with them exactly once."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if any(n < 0 for n in self.shape):
            raise ValueError(f"negative extent in shape {self.shape}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BytesEntry:
    """A non-tensor item: one opaque record (``torch.save`` bytes of the object for torch's
    planner; Megatron's ShardedObjects, already serialised)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageInfo:
    """Where one record lives: ``length`` bytes at ``offset`` of ``relative_path``."""

    relative_path: str
    """File name relative to the checkpoint directory; never absolute, never ``..``."""
    offset: int
    length: int
    transform_descriptors: tuple[str, ...] = ()
    """Stream transforms applied on write (compression), innermost last; empty for plain records."""

    def __post_init__(self) -> None:
        reason = unsafe_path_reason(self.relative_path)
        if reason:
            raise ValueError(f"relative path {self.relative_path!r} {reason}")
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"negative byte range ({self.offset}, {self.length})")


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveInfo:
    """torch's ``StorageMeta``: which save wrote the checkpoint (informational only)."""

    checkpoint_id: str | None = None
    """The writer's checkpoint path or URL, as the writer saw it."""
    save_id: str | None = None
    load_id: str | None = None
    modules: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpMetadata:
    """What a DCP checkpoint's ``.metadata`` says, as plain records (mappings: read-only)."""

    entries: Mapping[str, TensorEntry | BytesEntry]
    """Every item by flattened name (FQN), in the order the file lists them."""
    storage: Mapping[StorageKey, StorageInfo]
    """Record location of every tensor chunk and byte item."""
    planner_data: Mapping[str, KeyPath] | None = None
    """torch's default planner: FQN -> key path in the original nested state dict."""
    save_info: SaveInfo | None = None
    version: str | None = None
    """DCP format version (torch 2.13 writes ``"1.0.0"``; files of older torch have none)."""
    mcore_data: Any = None
    """megatron-core's per-key extras (e.g. ``nd_reformulated_orig_global_shape``), plain data."""
    ignored: tuple[str, ...] = ()
    """Parts of the file not interpreted (e.g. ``Metadata.all_local_plans``), for reports."""


DTYPE_NAMES: frozenset[str] = frozenset(DTYPES)
"""dtypes a ``.metadata`` may name (``torch.<name>`` globals): the plain numeric ones."""

_UNSAFE_PATH = re.compile(r"^(?:[\\/]|[A-Za-z]:)")  # POSIX/UNC root or Windows drive


def unsafe_path_reason(path: str) -> str | None:
    """Why ``path`` may not name a record inside a checkpoint directory, or None if it may."""
    if not path or "\x00" in path:
        return "is empty or contains NUL"
    if _UNSAFE_PATH.match(path):
        return "is absolute and escapes the checkpoint directory"
    if ".." in re.split(r"[\\/]", path):
        return "contains '..' and escapes the checkpoint directory"
    return None
