"""DTensors written as the source's torch release pickled them, on a device mesh of another
world size or shape (one flat FSDP2 mesh, or HSDP's replicas of shard groups): each object a
source DTensor's pickle holds (its spec, placements, tensor meta, the wrapper-subclass
arguments) is written back as it was read, only the mesh's shape, the rank's place in it and
the placements per mesh dimension changed and the cached hashes dropped (torch recomputes
them). A mesh or spec field this code does not know how to change is refused by name, never
copied: a mesh that says the wrong world would place shards wrong on load.

Nothing of torch is imported: the objects are the unpickler's inert stubs, pickled back under
their original global names (``torchsave.zip_writer``)."""

from __future__ import annotations

from typing import Any, SupportsIndex

from ckptctl.errors import CheckpointError
from ckptctl.formats.torchsave.dtensor import DTENSOR, LOCAL, DTensorRef
from ckptctl.formats.torchsave.unpickle import Stub, _stub_type
from ckptctl.formats.torchsave.zip_writer import TensorSlot

_REBUILD_FROM_TYPE = _stub_type("torch._tensor", "_rebuild_from_type_v2")
_WRAPPER = _stub_type("torch._utils", "_rebuild_wrapper_subclass")
_SIZE = _stub_type("torch", "Size")

MESH_FIELDS = frozenset(
    {
        "_device_type",
        "_layout",
        "_rank_map",
        "_mesh_dim_names",
        "_root_mesh",
        "_flatten_rank_map",
        "_thread_id",
        "_flatten_mapping",
        "_dim_group_names",
        "_rank",
        "_coordinate_on_dim",
        "_hash",
    }
)
"""A ``DeviceMesh``'s pickled fields (torch 2.9 - 2.13) that are known: what
each means for another world size is rewritten below, or kept."""


def _copy(stub: Stub, state: Any) -> Stub:
    """A stub of the same class, built the same way, with ``state``."""
    out = type(stub).__new__(type(stub), *stub._args)
    out._newobj = stub._newobj
    out._state = state
    return out


def _fields(stub: Any, what: str, where: str) -> dict[str, Any]:
    state = getattr(stub, "_state", None)
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{where}: a DTensor's {what} pickled as {type(state).__name__}, not the fields "
            "ckptctl rewrites for another world size (a torch release it does not know)"
        )
    return state


def _flat_axes(layout: Any, where: str) -> list[dict[str, Any]]:
    """The mesh's axes: one flat range of ranks (FSDP2), or HSDP's two (replicas of ``S``
    ranks each, then the ``S`` shards: strides ``S`` and 1)."""
    state = _fields(layout, "mesh layout", where)
    axes = state.get("axes")
    if not isinstance(axes, tuple) or len(axes) not in (1, 2):
        raise CheckpointError(f"{where}: a DTensor on a mesh of more than two dimensions")
    flats = [_fields(axis, "mesh axis", where) for axis in axes]
    for flat in flats:
        if set(flat) != {"shape", "stride"}:
            raise CheckpointError(f"{where}: a DTensor's mesh axis {flat}: not one flat range")
    sizes = [_int(f["shape"]) for f in flats]
    strides = [_int(f["stride"]) for f in flats]
    if strides[-1] != 1 or (len(flats) == 2 and strides[0] != sizes[1]):
        raise CheckpointError(
            f"{where}: a DTensor's mesh axes {flats}: not HSDP's replicas of shard groups"
        )
    return flats


def _int(value: Any) -> int | None:
    """A layout's size or stride: an int, or a one-element tuple of one."""
    return value[0] if isinstance(value, tuple) and len(value) == 1 else value


def shard_group(template: Any, where: str) -> int | None:
    """The ranks a DTensor is cut over on ``template``'s mesh: ``None`` for one flat range
    (every rank of the world), the shard group's size on HSDP's two-dimensional mesh."""
    layout = _fields(template, "device mesh", where).get("_layout")
    flats = _flat_axes(layout, where)
    return _int(flats[1]["shape"]) if len(flats) == 2 else None


def mesh_kept(template: Any, world: int, where: str) -> tuple[int, ...]:
    """The mesh ``template``'s run would have at ``world`` ranks, its shard groups kept: a plan
    made before plans said the mesh (``FileWrite.mesh``) is written so."""
    group = shard_group(template, where)
    return (world // group, group) if group else (world,)


def _axes_for(layout: Stub, mesh: tuple[int, ...], where: str) -> Stub:
    """The mesh's layout for ``mesh``: one flat axis, or HSDP's replicas (stride: the shard
    group) of shard groups (stride 1), each axis pickled as the source's are."""
    state = _fields(layout, "mesh layout", where)
    flats = _flat_axes(layout, where)
    axes: tuple[Any, ...] = state["axes"]
    boxed = isinstance(flats[0]["shape"], tuple)  # (n,) as torch 2.13 pickles it, or n
    new = []
    for dim, size in enumerate(mesh):
        stride = mesh[1] if dim == 0 and len(mesh) == 2 else 1
        shape = {"shape": (size,) if boxed else size, "stride": (stride,) if boxed else stride}
        new.append(_copy(axes[min(dim, len(axes) - 1)], shape))
    return _copy(layout, {**state, "axes": tuple(new)})


FSDP_NAMES = {("fsdp",): ("ddp", "fsdp")}
"""The mesh dimension names verl gives a flat FSDP2 mesh and an HSDP one
(``create_device_mesh`` in verl 0.9.1's FSDP engine), so one becomes the other."""


def _dim_names(names: Any, dims: int, where: str) -> Any:
    """The mesh dimension names at ``dims`` dimensions: the source's where the count is the
    same or there are none; HSDP's shard dimension alone for a flat mesh; verl's names for a
    flat mesh made HSDP. torch compares them when loading optimizer state (``DeviceMesh``'s
    ``__eq__``), so a name is never made up."""
    if names is None or len(names) == dims:
        return names
    if dims == 1:
        return tuple(names[1:])
    hsdp = FSDP_NAMES.get(tuple(names))
    if hsdp is None:
        raise CheckpointError(
            f"{where}: the device mesh's dimension is named {names[0]!r}, not verl's 'fsdp': "
            "ckptctl does not know what the run names HSDP's replica dimension"
        )
    return hsdp


def _group_names(mesh: tuple[int, ...], rank: int) -> list[str]:
    """The process group names torch gives a fresh run's mesh, as ``rank`` holds them: the
    default group (``"0"``) for a flat mesh of the world; for HSDP, the replica groups (one per
    shard index) then the shard groups (one per replica), numbered from 1 in that order. The
    saving run's names mean nothing in another process (torch warns loading them)."""
    if len(mesh) == 1:
        return ["0"]
    group = mesh[1]
    return [str(1 + rank % group), str(1 + group + rank // group)]


def mesh_for(
    template: Any, mesh: tuple[int, ...], rank: int, rank_map: TensorSlot, where: str
) -> Stub:
    """Rank ``rank``'s view of a device mesh shaped ``mesh`` (``(world,)`` or HSDP's
    ``(replicas, shard group)``), as ``template`` (a source rank's mesh) would be had the run
    had that mesh."""
    state = _fields(template, "device mesh", where)
    unknown = sorted(set(state) - MESH_FIELDS)
    if unknown:
        raise CheckpointError(
            f"{where}: the device mesh holds {', '.join(unknown)}, which ckptctl does not know "
            "how to set for another world size (a newer torch release)"
        )
    group = shard_group(template, where)
    names = state.get("_mesh_dim_names")
    if (
        state.get("_root_mesh") is not None
        or state.get("_flatten_mapping")
        or (names is not None and len(names) != (1 if group is None else 2))
    ):
        raise CheckpointError(f"{where}: a DTensor on a sub-mesh or a flattened mesh")
    world = mesh[0] * mesh[-1] if len(mesh) == 2 else mesh[0]
    new = dict(state)
    new["_layout"] = _axes_for(state["_layout"], mesh, where)
    new["_mesh_dim_names"] = _dim_names(names, len(mesh), where)
    if "_rank_map" in new:
        new["_rank_map"] = rank_map
    if "_flatten_rank_map" in new:
        new["_flatten_rank_map"] = tuple(range(world))
    if "_dim_group_names" in new:
        new["_dim_group_names"] = _group_names(mesh, rank)
    new["_rank"] = rank
    new["_coordinate_on_dim"] = (rank,) if len(mesh) == 1 else (rank // mesh[1], rank % mesh[1])
    new["_hash"] = None  # recomputed by torch from the fields above
    return _copy(template, new)


PLACEMENTS = (("Shard",), ("Replicate", "Shard"))
"""FSDP2's ``Shard(0)`` on one mesh dimension, and HSDP's replicas of it."""


def check_placement(ref: DTensorRef, where: str) -> None:
    """Only FSDP2's and HSDP's placements are recut."""
    if ref.placements not in PLACEMENTS or ref.offsets[1:] != (0,) * (len(ref.shape) - 1):
        raise CheckpointError(
            f"{where}: a DTensor placed {list(ref.placements)}; verl files are written at "
            "another world size from FSDP2's Shard(0), or HSDP's (Replicate(), Shard(0))"
        )


_REPLICATE = _stub_type("torch.distributed.tensor.placement_types", "Replicate")
SPEC_FIELDS = frozenset(
    {"mesh", "placements", "tensor_meta", "shard_order", "use_strided_shard_as_shard_order"}
)
"""A ``DTensorSpec``'s pickled fields (torch 2.9 - 2.13, with ``_hash``) that are rewritten
for a mesh of another number of dimensions."""


def _placed(state: dict[str, Any], dims: int, where: str) -> dict[str, Any]:
    """The spec's per-mesh-dimension fields for ``dims`` dimensions: ``Shard(0)`` on the last
    (the shard group's), ``Replicate()`` before it (HSDP); the shard order (torch >= 2.10)
    naming that dimension."""
    placements: tuple[Any, ...] = state["placements"]
    if len(placements) == dims:
        return {}
    unknown = sorted(set(state) - SPEC_FIELDS - {"_hash"})
    if unknown:
        raise CheckpointError(
            f"{where}: a DTensor spec holds {', '.join(unknown)}, which ckptctl does not know "
            "how to set for a mesh of another number of dimensions"
        )
    shard = placements[-1]
    if dims == 1:
        new: dict[str, Any] = {"placements": (shard,)}
    else:
        replicate = _REPLICATE.__new__(_REPLICATE)
        replicate._state = {}  # as torch pickles it: NEWOBJ, then an empty BUILD
        new = {"placements": (replicate, shard)}
    order = state.get("shard_order")
    if order is not None:
        entries = []
        for entry in order:
            args: tuple[Any, ...] = getattr(entry, "_args", ())
            if not isinstance(entry, Stub) or len(args) != 2 or len(args[1]) != 1:
                raise CheckpointError(
                    f"{where}: a DTensor's shard order {order!r} is not one Shard's"
                )
            moved = _copy(entry, entry._state)
            moved._args = (args[0], (dims - 1,))
            entries.append(moved)
        new["shard_order"] = tuple(entries)
    return new


def _spec_for(spec: Any, mesh: Stub, dims: int, where: str) -> Stub:
    state = _fields(spec, "spec", where)
    meta = state.get("tensor_meta")
    args: tuple[Any, ...] = getattr(meta, "_args", ())
    if not isinstance(meta, Stub) or len(args) != 3:
        raise CheckpointError(f"{where}: a DTensor spec without its tensor meta")
    shape, stride, dtype = args
    new_meta = _copy(meta, None)
    new_meta._args = (_SIZE(tuple(shape)), stride, dtype)  # torch.Size, as torch pickles it
    new = {**state, "mesh": mesh, "tensor_meta": new_meta, **_placed(state, dims, where)}
    if "_hash" in new:
        new["_hash"] = None
    return _copy(spec, new)


class RebuiltDTensor:
    """A DTensor to pickle: ``_rebuild_from_type_v2`` of the wrapper subclass with the
    source's arguments (global size, stride, dtype), this rank's local tensor and spec."""

    def __init__(
        self, ref: DTensorRef, local: TensorSlot, mesh: Stub, dims: int, where: str
    ) -> None:
        self.args = ref.args
        fields = {LOCAL: local, "_spec": _spec_for(ref.spec, mesh, dims, where)}
        self.state: Any = (None, fields) if ref.slotted else fields
        if not isinstance(ref.args, tuple) or not ref.args:
            raise CheckpointError(f"{where}: a DTensor pickled without its rebuild arguments")

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        dtensor = _stub_type(*DTENSOR)
        return (_REBUILD_FROM_TYPE, (_WRAPPER, dtensor, self.args, self.state))
