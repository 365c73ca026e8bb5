"""The distributed optimizer's ``fully_sharded_model_space`` form (megatron-core <= 0.14). Pure.

Before megatron-core 0.14 the distributed optimizer saved its state under
``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>`` (the default
``distrib_optim_sharding_type``), each tensor "N-D flattened": the parameter's global shape
``G`` is cut into its model-parallel boxes (one per layer, TP shard, expert, SwiGLU half), and
the stored tensor has shape ``fragments + (box numel,)``, ``fragments[d] = G[d] // box[d]``.
Each last-dimension row is one box in C order, cut by the data-parallel ranks' ranges of the
grad buffer, so a chunk ``(f_0, ..., f_{n-1}, start)`` of sizes ``(1, ..., 1, n)`` holds
elements ``[start, start + n)`` of box ``f``. Megatron-Core 0.12-0.13 also record ``G`` as
``nd_reformulated_orig_global_shape``; the model tensor of the same key has it too, which is
what this module takes, or the recorded shape when the model was saved apart (verl's bridge
saves: ``joined``), so it needs nothing beyond the DCP metadata.
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

from ckptctl.formats.dcp_container.metadata import DcpMetadata, TensorEntry
from ckptctl.formats.megatron_common.distopt_layout import chained_prefix
from ckptctl.formats.megatron_common.sharded_keys import (
    ChunkPart,
    chunk_parts,
    model_catalog,
    record_geometry,
    split_key,
)
from ckptctl.formats.torch_dist.dp_reshardable import flat_boxes
from ckptctl.model.catalog import Param
from ckptctl.model.geometry import Shape, Split, chunk_pieces
from ckptctl.model.layout import ModelSpec
from ckptctl.model.stored import StoredFile, StoredTensor

FORM = "fully_sharded_model_space"


def box_shape(stored: Shape, model: Shape) -> Shape | None:
    """The shape of one model-parallel box of a parameter of global shape ``model`` whose
    N-D flattened optimizer state is ``stored``; ``None`` if ``stored`` is not such a form."""
    fragments, numel = stored[:-1], stored[-1] if stored else 0
    if len(fragments) != len(model):
        return None
    if any(f <= 0 or g % f for g, f in zip(model, fragments, strict=True)):
        return None
    box = tuple(g // f for g, f in zip(model, fragments, strict=True))
    return box if prod(box) == numel else None


def model_space_box(fqn: str, entry: TensorEntry, metadata: DcpMetadata) -> tuple[int, ...] | None:
    """The box shape of ``fqn``'s N-D flattened optimizer state (``None`` for a model key):
    from the shape of the model tensor it is the state of, or, saved without the model (verl's
    optimizer alone), the shape megatron-core 0.12-0.13 record for it."""
    state, key = split_key(fqn)
    if state is None or state == "?":
        return None
    model = metadata.entries.get(key)
    if isinstance(model, TensorEntry):
        return box_shape(tuple(entry.shape), tuple(model.shape))
    extras = metadata.mcore_data.get(fqn) if isinstance(metadata.mcore_data, dict) else None
    shape = extras.get("nd_reformulated_orig_global_shape") if isinstance(extras, dict) else None
    if not isinstance(shape, tuple | list) or not all(isinstance(n, int) for n in shape):
        return None
    return box_shape(tuple(entry.shape), tuple(shape))


def flattened_parts(
    fqn: str,
    box: Shape,
    offsets: Shape,
    sizes: Shape,
    catalog: dict[str, Param],
) -> list[ChunkPart] | None:
    """The canonical parts of chunk ``(offsets, sizes)`` of the N-D flattened ``fqn`` whose boxes
    have shape ``box``: each a run of the chunk's elements (``view_offset`` into the chunk's flat
    record) viewed as the box of the model tensor it flattens. ``None`` when the chunk is not one
    box's range or the key is not a parameter's state."""
    *fragment, start = offsets
    *ones, length = sizes
    if len(fragment) != len(box) or any(n != 1 for n in ones):
        return None
    origin = tuple(f * b for f, b in zip(fragment, box, strict=True))
    out: list[ChunkPart] = []
    for inner, run, flat in flat_boxes(box, start, start + length):
        at = tuple(o + i for o, i in zip(origin, inner, strict=True))
        parts = chunk_parts(fqn, at, run, catalog)
        if parts is None:
            return None
        out.extend(
            ChunkPart(
                p.canonical,
                p.shape,
                flat - start + (p.view_offset or 0),
                p.pieces,
                # an unstacked key's box lies in the padded tensor where its offsets say
                None if p.pieces or len(p.shape) != len(at) else at,
            )
            for p in parts
        )
    return out


MASTER_PREFIX = "optimizer.state.fp32_param."
"""The fp32 masters' keys in this form (``fully_reshardable`` names them ``param``): under the
distributed optimizer, a key so named marks the form."""


def is_model_space_key(fqn: str) -> bool:
    """Whether ``fqn`` is distributed-optimizer state in this form (given the run has the
    distributed optimizer: the mixed-precision wrapper also names its masters so)."""
    return fqn[len(chained_prefix(fqn)) :].startswith(MASTER_PREFIX)


def flattened_files(
    files: tuple[StoredFile, ...], spec: ModelSpec, tp: int
) -> tuple[StoredFile, ...]:
    """``torch_dist`` target files whose per-parameter optimizer state (``fully_reshardable``
    chunks: one model-parallel box each) is written in this form instead: each chunk becomes
    fragment ``offsets // sizes`` of its N-D flattened key, one whole box (the loader reads any
    data-parallel cut of it), its ``base_shape`` the key's global shape. The bytes are the same
    C-ordered box; only the key and its geometry change."""
    return tuple(
        replace(
            file,
            tensors=tuple(
                flat
                for tensor in file.tensors
                for half in _gated_halves(tensor, spec, tp)
                for flat in (_flattened(half, spec, tp),)
            ),
        )
        for file in files
    )


def _gated_halves(tensor: StoredTensor, spec: ModelSpec, tp: int) -> tuple[StoredTensor, ...]:
    """A SwiGLU ``linear_fc1`` chunk that holds both halves (TP 1) as its gate and up boxes:
    megatron-core cuts the halves apart at every TP size, and this form's fragments are its
    boxes, so the loader's grid must be met exactly (``fully_reshardable`` reads any box)."""
    if split_key(str(tensor.key[0]))[0] is None:
        return (tensor,)
    param = model_catalog(spec)[tensor.canonical.split("/", 1)[-1]]
    box = param.shape[0] // (2 * tp)
    if param.split is not Split.GATED or tensor.shape[0] != 2 * box:
        return (tensor,)
    row = len(tensor.key) - 1 - len(tensor.shape)  # the key's row offset, behind layer / expert
    out = []
    for half in (0, 1):
        local = (half * box, *(0,) * (len(tensor.shape) - 1))
        sizes = (box, *tensor.shape[1:])
        key = list(tensor.key)
        key[1 + row] = int(key[1 + row]) + half * box
        pieces = chunk_pieces(tensor.pieces, local, sizes)
        out.append(replace(tensor, key=tuple(key), shape=sizes, pieces=pieces))
    return tuple(out)


def _flattened(tensor: StoredTensor, spec: ModelSpec, tp: int) -> StoredTensor:
    fqn = str(tensor.key[0])
    state, key = split_key(fqn)
    if state is None:
        return tensor
    global_shape, _ = record_geometry(fqn, tensor.canonical, tensor.shape, spec, tp)
    offsets = tuple(int(k) for k in tensor.key[1:])
    # The chunk's sizes: the tensor's own shape behind the stacked (layer, expert) dimensions.
    sizes = (*(1,) * (len(offsets) - len(tensor.shape)), *tensor.shape)
    fragments = tuple(g // s for g, s in zip(global_shape, sizes, strict=True))
    index = tuple(o // s for o, s in zip(offsets, sizes, strict=True))
    prefix = chained_prefix(fqn)
    name = f"{prefix}{MASTER_PREFIX if state == 'fp32_param' else f'optimizer.state.{state}.'}"
    return replace(
        tensor,
        key=(f"{name}{key}", *index, 0),
        base_shape=(*fragments, prod(tensor.shape)),
    )
