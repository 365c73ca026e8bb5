"""A training state dict as ckptctl stores it: flattened names, and for each tensor the box of
the global tensor this rank holds.

Names follow torch DCP's default planner exactly (``flatten_state_dict``: keys of nested
mappings joined by ``.``, lists entered only when they hold tensors or mappings), so a checkpoint
saved by ckptctl loads with ``torch.distributed.checkpoint.load`` and the other way round;
``tests/training/test_training.py`` checks the names against torch's own function.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ckptctl.errors import UsageError

Path = tuple[str | int, ...]


@dataclass
class TensorItem:
    """One tensor of the state dict as this rank holds it."""

    fqn: str
    path: Path
    local: torch.Tensor
    """This rank's part (a DTensor's local shard; a plain tensor whole)."""
    shape: tuple[int, ...]
    """Global shape."""
    offsets: tuple[int, ...]
    """Where ``local`` starts in the global tensor."""
    shared: bool
    """Every rank holds the same box (a plain tensor, or a DTensor replicated on every mesh
    dimension): one rank, chosen by ``assign_writers``, stores it."""
    writer: bool
    """This rank stores the box (for a DTensor: its coordinate is 0 on every replicated mesh
    dimension, so each box is stored once)."""

    @property
    def dtype(self) -> str:
        return str(self.local.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


@dataclass
class ValueItem:
    """Anything else (numbers, strings, tuples, ...): stored as one ``torch.save`` record."""

    fqn: str
    path: Path
    value: Any


Item = TensorItem | ValueItem


def is_stateful(value: Any) -> bool:
    """torch DCP's ``Stateful``: an object saved through ``state_dict()`` and restored through
    ``load_state_dict()`` (an app state wrapping a model and its optimizer)."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def resolve_stateful(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict with each top-level ``Stateful`` replaced by its ``state_dict()``."""
    return {k: v.state_dict() if is_stateful(v) else v for k, v in state_dict.items()}


def _is_leaf(value: Any, tensor: type | tuple[type, ...]) -> bool:
    """Mappings are always entered; a list only when it holds a tensor or a list or mapping
    that is entered; everything else (tuples too) is one item."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(
        isinstance(v, tensor) or (isinstance(v, Mapping | list) and not _is_leaf(v, tensor))
        for v in value
    )


@dataclass(frozen=True)
class Leaf:
    path: Path
    value: Any
    parent: Any
    """The mapping or list holding the leaf, and its key there (for loading in place)."""
    key: Any


def flatten(
    state_dict: Mapping[str, Any], tensor: type | tuple[type, ...] = torch.Tensor
) -> dict[str, Leaf]:
    """Every leaf by its flattened name, in traversal order (``tensor``: what counts as a
    tensor, e.g. the references of a ``torch.save`` file read without torch)."""
    out: dict[str, Leaf] = {}

    def visit(path: Path, value: Any, parent: Any, key: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), v, value, k)
        elif _is_leaf(value, tensor):
            name = ".".join(map(str, path))
            if name in out:
                raise UsageError(f"state dict: two entries flatten to the name {name!r}")
            out[name] = Leaf(path, value, parent, key)
        else:
            for i, v in enumerate(value):
                visit((*path, i), v, value, i)

    for key, value in state_dict.items():
        visit((str(key),), value, state_dict, key)
    return out


def _dtensor_box(fqn: str, t: DTensor) -> tuple[tuple[int, ...], bool, bool]:
    """Global offsets of a DTensor's local shard, whether every rank holds all of it, and
    whether this rank stores it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    for p in t.placements:
        # FSDP2 over tensor parallelism shards a TP shard again (_StridedShard): each rank's
        # piece is still one box of the global tensor, where torch's DCP places it too.
        if type(p) not in (Shard, Replicate, _StridedShard):
            raise UsageError(
                f"state dict: {fqn} is a DTensor with placement {p}; ckptctl stores Shard, "
                "FSDP's strided Shard and Replicate placements (redistribute it, e.g. "
                "full_tensor() or Replicate(), before saving)"
            )
    _refuse_split_pieces(fqn, t)
    coordinate = t.device_mesh.get_coordinate()
    local, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local) != tuple(t.to_local().shape):
        raise UsageError(
            f"state dict: {fqn}'s local shard ({list(t.to_local().shape)}) under placements "
            f"{t.placements} is not the box torch computes for it ({list(local)}); "
            "redistribute it before saving"
        )
    shared = all(isinstance(p, Replicate) for p in t.placements)
    writer = coordinate is not None and all(
        c == 0 for c, p in zip(coordinate, t.placements, strict=True) if isinstance(p, Replicate)
    )
    return tuple(int(o) for o in offsets), shared, writer


def _refuse_split_pieces(fqn: str, t: DTensor) -> None:
    """A strided shard is one box of the tensor on each rank only when the mesh dimensions
    after it cut the same tensor dimension into exactly its ``split_factor`` (FSDP2 over TP:
    ``(_StridedShard(0, split_factor=TP), Shard(0))``). Otherwise each rank holds several
    strips (transformers' packed tensor parallelism, ``packed_colwise``: a gate strip and an up
    strip), which torch's offsets describe as one box: refused, never stored in wrong rows."""
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = t.device_mesh, t.placements
    for i, p in enumerate(placements):
        if not isinstance(p, _StridedShard):
            continue
        later = 1
        for j in range(i + 1, len(placements)):
            q = placements[j]
            if isinstance(q, Shard) and q.dim == p.dim:  # _StridedShard is a Shard too
                later *= mesh.size(j)
        if later != p.split_factor:
            raise UsageError(
                f"state dict: {fqn} is placed {list(placements)}: each rank holds strips of "
                f"its dimension {p.dim}, not one box of it (packed tensor parallelism, as "
                "transformers' packed_colwise); ckptctl stores a shard that is one box: "
                "redistribute it (full_tensor(), or Shard) before saving or loading"
            )


def items_of(state_dict: Mapping[str, Any]) -> dict[str, Item]:
    """Every entry of ``state_dict`` (Stateful objects already resolved) as this rank holds it."""
    items: dict[str, Item] = {}
    for fqn, found in flatten(state_dict).items():
        path, leaf = found.path, found.value
        if isinstance(leaf, DTensor):
            offsets, shared, writer = _dtensor_box(fqn, leaf)
            local = leaf.to_local()
            items[fqn] = TensorItem(fqn, path, local, tuple(leaf.shape), offsets, shared, writer)
        elif isinstance(leaf, torch.Tensor):
            if leaf.is_sparse or leaf.is_nested or leaf.is_quantized:
                raise UsageError(
                    f"state dict: {fqn} is a {leaf.layout} tensor; ckptctl stores dense tensors"
                )
            zero = (0,) * leaf.dim()
            items[fqn] = TensorItem(fqn, path, leaf, tuple(leaf.shape), zero, True, True)
        else:
            items[fqn] = ValueItem(fqn, path, leaf)
    return items


def assign_writers(items: Mapping[str, Item], rank: int, world: int) -> set[str]:
    """Names this rank stores. A box every rank holds (plain tensors, fully replicated
    DTensors, values) is stored by one rank; they are dealt out largest first to the rank with
    the fewest bytes so far, which every rank works out alike without talking to the others."""
    load = [0] * world
    mine = {
        fqn
        for fqn, item in items.items()
        if isinstance(item, TensorItem) and not item.shared and item.writer
    }
    shared = [
        (item.nbytes if isinstance(item, TensorItem) else 1, fqn)
        for fqn, item in items.items()
        if isinstance(item, ValueItem) or item.shared
    ]
    for size, fqn in sorted(shared, key=lambda s: (-s[0], s[1])):
        target = min(range(world), key=lambda r: (load[r], r))
        load[target] += size
        if target == rank:
            mine.add(fqn)
    return mine
