"""DTensors in ``torch.save`` files (verl's FSDP shards: each rank saves ``model.state_dict()``
of an FSDP2 model): read as ``DTensorRef`` records, the rank's local tensor and where it lies
in the global tensor, from what the pickle holds (global shape, placements, the rank's mesh
coordinate). Nothing of ``torch.distributed`` is imported or run: its classes are inert stubs
(``unpickle.Stub``) whose recorded arguments and state are read here."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any

from ckptctl.errors import UnsafePickleError

Shape = tuple[int, ...]

DTENSOR = ("torch.distributed.tensor", "DTensor")
LOCAL = "_local_tensor"
"""The key path step from a DTensor to its local tensor (``resolve`` follows it)."""


@dataclass(frozen=True, slots=True)
class DTensorRef:
    """A DTensor as one rank saved it: its local tensor (a ``TensorRef``), the global shape,
    and the box of it that is local."""

    local: Any
    shape: Shape
    offsets: Shape
    placements: tuple[str, ...]
    spec: Any = field(default=None, compare=False)
    """The pickled spec (a ``Stub``: mesh, placements, tensor meta), kept so a writer of the
    same torch release's files can mirror it (``ckptctl.formats.verl.dtensors``)."""
    args: Any = field(default=None, compare=False)
    """The pickled arguments of ``_rebuild_wrapper_subclass`` (global size, dtype, ...)."""
    slotted: bool = field(default=True, compare=False)
    """Its state was pickled as ``(dict, slots)`` (a DTensor with ``__slots__``)."""

    def __getitem__(self, key: str) -> Any:
        if key != LOCAL:
            raise KeyError(key)
        return self.local


def _state(stub: Any) -> dict[str, Any]:
    state = getattr(stub, "_state", None)
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}  # (dict, slots) of a slotted dataclass
    return state if isinstance(state, dict) else {}


def _name(stub: Any) -> str:
    return getattr(stub, "_global", ("", ""))[1]


def torch_chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s cut (what ``Shard`` placements use): start and length of part
    ``index`` of ``parts``."""
    step = -(-size // parts) if parts else 0
    start = min(size, index * step)
    return start, min(size, start + step) - start


def dtensor_ref(state: Any, where: str, args: Any = None) -> DTensorRef:
    """The ``DTensorRef`` a pickled DTensor's state describes; anything unexpected is refused
    (a box placed wrong would put weights in the wrong rows)."""
    slotted = isinstance(state, tuple)
    if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a slotted class
        state = {**(state[0] or {}), **(state[1] or {})}
    if not isinstance(state, dict) or LOCAL not in state or "_spec" not in state:
        raise UnsafePickleError(f"{where}: a DTensor without its local tensor and spec")
    local, spec = state[LOCAL], _state(state["_spec"])
    meta, mesh = spec.get("tensor_meta"), _state(spec.get("mesh"))
    meta_args = getattr(meta, "_args", ())
    if not meta_args:
        raise UnsafePickleError(f"{where}: a DTensor whose spec holds no global shape")
    shape = tuple(int(n) for n in meta_args[0])
    layout = _state(mesh.get("_layout"))
    sizes = tuple(int(n) for n in _mesh_shape(layout, where))
    coordinate = mesh.get("_coordinate_on_dim")
    placements = spec.get("placements") or ()
    if coordinate is None or len(coordinate) != len(sizes) or len(placements) != len(sizes):
        raise UnsafePickleError(
            f"{where}: a DTensor whose mesh {list(sizes)} and coordinate {coordinate} do not "
            "match its placements (was it saved by a rank outside the mesh?)"
        )
    offsets = [0] * len(shape)
    lengths = list(shape)
    names = []
    for placement, parts, index in zip(placements, sizes, coordinate, strict=True):
        kind = _name(placement)
        names.append(kind)
        if kind == "Replicate":
            continue
        if kind != "Shard":
            raise UnsafePickleError(
                f"{where}: a DTensor placed {kind}; per-rank files are read for Shard and "
                "Replicate placements (save such a state dict with torch's DCP instead)"
            )
        dim = int(_state(placement).get("dim", -1))
        if not 0 <= dim < len(shape):
            raise UnsafePickleError(f"{where}: a DTensor sharded on dimension {dim}")
        start, length = torch_chunk(lengths[dim], parts, int(index))
        offsets[dim] += start
        lengths[dim] = length
    local_shape = tuple(getattr(local, "shape", ()))
    if local_shape != tuple(lengths):
        raise UnsafePickleError(
            f"{where}: a DTensor's local tensor is {list(local_shape)}, but its placements "
            f"{names} give this rank {lengths}"
        )
    return DTensorRef(local, shape, tuple(offsets), tuple(names), state["_spec"], args, slotted)


def _mesh_shape(layout: dict[str, Any], where: str) -> Shape:
    """Each mesh dimension's size: one flat layout per dimension, its (possibly several)
    sizes multiplied."""
    sizes = []
    for axis in layout.get("axes") or ():
        shape = _state(axis).get("shape")
        shape = (shape,) if isinstance(shape, int) else shape
        if not shape or not all(isinstance(n, int) for n in shape):
            raise UnsafePickleError(f"{where}: a DTensor whose device mesh has no shape")
        sizes.append(prod(shape))
    if not sizes:
        raise UnsafePickleError(f"{where}: a DTensor whose device mesh has no shape")
    return tuple(sizes)
