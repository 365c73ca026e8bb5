"""Megatron-Core ``torch_dist`` keys and boxes, both ways. Pure.

A ``torch_dist`` checkpoint is a PyTorch DCP checkpoint whose keys are Megatron-Core's sharded
keys: layer parameters drop the layer number and gain a leading layer dimension
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[L, rows, h]``), vocabulary tensors
keep their padded rows, and ``fully_reshardable`` optimizer state mirrors each parameter under
``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``. The global tensors are the canonical ones
(QKV group-major, SwiGLU ``[gate; up]``) up to vocabulary padding, so every stored chunk is a box
of one canonical tensor per layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from math import prod
from typing import Any

from ckptctl.formats.megatron_common.distopt_layout import CHAINED
from ckptctl.formats.megatron_common.layout import RankParam, rank_params
from ckptctl.model.catalog import (
    EXPERTS,
    LAYER_PREFIX,
    MLA_DOWN_PROJECTIONS,
    Naming,
    Param,
    expert_name,
    layer_parts,
    local_layer_name,
    parameters,
    state_name,
    te_layer_suffix,
)
from ckptctl.model.geometry import Piece, Shape, Split, shard_shape_and_pieces
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.linear_attention import PART_NAMES
from ckptctl.model.stored import StoredFile, StoredTensor

OPTIMIZER_PREFIX = "optimizer.state."
_STATE_FROM_KEY = {"param": "fp32_param", "fp32_param": "fp32_param"} | {
    s: s for s in ("exp_avg", "exp_avg_sq")
}
_KEY_FROM_STATE = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@dataclass(frozen=True, slots=True)
class ChunkPart:
    """The part of a stored chunk that holds one canonical tensor."""

    canonical: str
    shape: Shape
    """Shape the part is read as (the chunk without its layer dimension)."""
    view_offset: int | None
    """Element offset of the part in the chunk, when the chunk spans several layers."""
    pieces: tuple[Piece, ...]
    padded_origin: Shape | None = None
    """Where a part of padding rows only lies in the padded tensor (its pieces cannot say)."""


EXPERTS_KEY = f"{EXPERTS}.experts."
"""Stacked expert keys: ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is
``[L, E, ...]``, the second dimension the global expert."""


def dense_optimizer(common_optimizer: Any) -> dict[str, Any]:
    """The (dense) optimizer's entry of ``common.pt``'s ``optimizer``: the entry itself, or under
    a chained dense + expert optimizer (``{0: dense, 1: experts}``) the first one."""
    if not isinstance(common_optimizer, dict):
        return {}
    first = common_optimizer.get(0, common_optimizer)
    return first if isinstance(first, dict) else {}


def split_key(fqn: str) -> tuple[str | None, str]:
    """``(optimizer state or None, model key)``; an unknown optimizer state gives ``("?", ...)``."""
    fqn = CHAINED.sub("", fqn)
    if fqn.startswith(OPTIMIZER_PREFIX):
        state, _, key = fqn[len(OPTIMIZER_PREFIX) :].partition(".")
        return _STATE_FROM_KEY.get(state, "?"), key
    return None, fqn


def is_stacked(key: str) -> bool:
    """Layer parameters of homogeneous layers carry a layer dimension instead of a number."""
    return key.startswith(LAYER_PREFIX) and not key[len(LAYER_PREFIX) :].split(".")[0].isdigit()


def _numbered_experts(key: str) -> tuple[str, str] | None:
    """``(layer prefix, expert suffix)`` of a numbered layer's (or an MTP layer's) stacked
    experts key."""
    parts = None if is_stacked(key) else layer_parts(key)
    if parts is None or not parts[1].startswith(EXPERTS_KEY):
        return None
    return parts[0], parts[1][len(EXPERTS_KEY) :]


def chunk_parts(
    fqn: str, offsets: Shape, sizes: Shape, catalog: dict[str, Param]
) -> list[ChunkPart] | None:
    """How chunk ``(offsets, sizes)`` of ``fqn`` maps onto canonical tensors; ``None`` when the
    key is not a parameter of the model (or its optimizer state)."""
    state, key = split_key(fqn)
    if state == "?":
        return None
    # Records with leading layer / expert dimensions hold their parts as views.
    leading = is_stacked(key) or _numbered_experts(key) is not None
    if is_stacked(key) and key[len(LAYER_PREFIX) :].startswith(EXPERTS_KEY):
        suffix = key[len(LAYER_PREFIX) + len(EXPERTS_KEY) :]
        (first, expert), (layers, experts) = offsets[:2], sizes[:2]
        inner_offsets, inner_sizes = offsets[2:], sizes[2:]
        names = [
            (expert_name(f"{LAYER_PREFIX}{first + i}.", expert + j, suffix), i * experts + j)
            for i in range(layers)
            for j in range(experts)
        ]
    elif (numbered := _numbered_experts(key)) is not None:
        # Dense and MoE layers mixed: megatron-core keys each layer by its number, a layer's
        # experts stacked in one dimension.
        prefix, suffix = numbered
        expert, experts = offsets[0], sizes[0]
        inner_offsets, inner_sizes = offsets[1:], sizes[1:]
        names = [(expert_name(prefix, expert + j, suffix), j) for j in range(experts)]
    elif is_stacked(key):
        suffix = key[len(LAYER_PREFIX) :]
        first, layers = offsets[0], sizes[0]
        inner_offsets, inner_sizes = offsets[1:], sizes[1:]
        names = [(f"{LAYER_PREFIX}{first + i}.{suffix}", i) for i in range(layers)]
    else:
        inner_offsets, inner_sizes = offsets, sizes
        names = [(key, 0)]
    parts = []
    per_layer = prod(inner_sizes)
    for name, index in names:
        param, start, rows = _part_of(name, catalog)
        if param is None or len(param.shape) != len(inner_sizes):
            return None
        limits = (rows, *param.shape[1:])
        clipped = tuple(
            max(0, min(o + n, limit) - o)
            for o, n, limit in zip(inner_offsets, inner_sizes, limits, strict=True)
        )
        at = (start + inner_offsets[0], *inner_offsets[1:])
        pieces = (Piece((0,) * len(clipped), at, clipped),) if all(clipped) else ()
        parts.append(
            ChunkPart(
                canonical=state_name(state, param.name) if state else param.name,
                shape=inner_sizes,
                # Layer parts are views of the record, which has the extra layer dimension.
                view_offset=index * per_layer if leading else None,
                pieces=pieces,
            )
        )
    return parts


_FUSED_PRE_MLP, _PRE_MLP = "mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."
"""The local spec saves an MoE layer's own pre-MLP norm under the dense layer's fused name."""


@lru_cache(maxsize=8)
def model_catalog(spec: ModelSpec) -> dict[str, Param]:
    return {p.name: p for p in parameters(spec)}


def _part_of(name: str, catalog: dict[str, Param]) -> tuple[Param | None, int, int]:
    """``(parameter, first row, rows)`` of the tensor a stored key names: a whole parameter,
    or one part of a parameter megatron-core saves in parts (``in_proj.weight.query``)."""
    param = _param_of(name, catalog)
    if param is not None:
        return param, 0, param.shape[0] if param.shape else 0
    base, _, part = name.rpartition(".")
    param = catalog.get(base)
    layer = layer_parts(base)
    names = PART_NAMES.get(layer[1], ()) if layer is not None else ()
    if param is None or not param.parts or part not in names:
        return None, 0, 0
    at = names.index(part)
    return param, sum(param.parts[:at]), param.parts[at]


def _param_of(name: str, catalog: dict[str, Param]) -> Param | None:
    """The parameter a stored key names: in TE spelling; the local spec's MoE norm under the
    fused name; or, under multi-latent attention (whose local spec maps no key to TE's), in the
    local spec's own spelling."""
    found = catalog.get(name) or catalog.get(name.replace(_FUSED_PRE_MLP, _PRE_MLP, 1))
    parts = layer_parts(name) if found is None else None
    if parts is not None:
        found = catalog.get(parts[0] + te_layer_suffix(parts[1], mla=True))
    return found


# --- writing -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TargetChunk:
    """One chunk a target rank writes: key, global shape, box, and the canonical pieces in it."""

    fqn: str
    global_shape: Shape
    offsets: Shape
    sizes: Shape
    canonical: str
    local_shape: Shape
    """The chunk without its layer dimension: what is assembled and streamed."""
    pieces: tuple[Piece, ...]


def local_split(rp: RankParam) -> RankParam:
    """``rp`` as the local spec splits it (MLA's down projections are column-parallel there)."""
    name = rp.param.name
    if layer_parts(name) is None or not name.endswith(tuple(MLA_DOWN_PROJECTIONS)):
        return rp
    return replace(rp, param=replace(rp.param, split=Split.COLUMN))


def torch_dist_key(
    param: Param, naming: Naming = Naming.TE, mla: bool = False, numbered: bool = False
) -> str:
    """The sharded key: layer parameters without their layer number (a leading layer
    dimension instead), routed experts also without their number (an expert dimension). An
    MTP layer's transformer layer keeps its prefix (no layer dimension)."""
    parts = layer_parts(param.name)
    if parts is None:
        return param.name
    prefix, suffix = parts
    if param.layer is not None:
        # Dense and MoE layers mixed: megatron-core keys each layer by its number.
        prefix = f"{LAYER_PREFIX}{param.layer}." if numbered else LAYER_PREFIX
    if param.expert is not None:
        expert = suffix.split(".local_experts.", 1)[1].split(".", 1)[1]
        return f"{prefix}{EXPERTS_KEY}{expert}"
    if naming is Naming.LOCAL and mla:
        # megatron-core's local multi-latent attention spec maps no key: local spelling.
        return f"{prefix}{local_layer_name(suffix, naming, mla=True)}"
    if naming is Naming.LOCAL and suffix.startswith(_PRE_MLP):
        # The local spec maps the MoE layer's norm onto the dense layer's fused name.
        suffix = suffix.replace(_PRE_MLP, _FUSED_PRE_MLP, 1)
    return f"{prefix}{suffix}"


def numbered_layers(spec: ModelSpec) -> bool:
    """Whether megatron-core keys each decoder layer by its number: layers of more than one
    kind (dense and MoE, gated delta net and attention)."""
    return bool(spec.dense_layers) or spec.linear_attention is not None


def _stacked(param: Param, spec: ModelSpec) -> bool:
    """Whether ``param``'s key has a leading layer dimension (homogeneous decoder layers)."""
    return param.layer is not None and not numbered_layers(spec)


def global_shape(param: Param, spec: ModelSpec, tp: int) -> Shape:
    shape = param.shape
    if param.split is Split.VOCAB:
        shape = (spec.padded_vocab_size(tp), *shape[1:])
    layers = (spec.num_layers,) if _stacked(param, spec) else ()
    if param.expert is not None:
        return (*layers, spec.num_experts or 0, *shape)
    return (*layers, *shape)


def optimizer_key(state: str, key: str, param: Param, layout: ParallelLayout) -> str:
    """``fully_reshardable`` optimizer state of ``key``; under a chained optimizer (EP > 1)
    prefixed by its optimizer: ``chained_0`` dense, ``chained_1`` the routed experts."""
    stored = _KEY_FROM_STATE[state]
    if state == "fp32_param" and not layout.distributed_optimizer:
        stored = "fp32_param"  # the mixed-precision wrapper's masters (``fp32_from_fp16_params``)
    name = f"{OPTIMIZER_PREFIX}{stored}.{key}"
    if layout.ep == 1:
        return name
    return f"chained_{int(param.expert is not None)}.{name}"


def rank_chunks(
    spec: ModelSpec,
    layout: ParallelLayout,
    rank: tuple[int, int, int],
    states: tuple[str, ...],
    naming: Naming = Naming.TE,
) -> list[TargetChunk]:
    """The main-replica chunks model-parallel rank ``(tp, pp, ep)`` saves: its TP boxes of
    every parameter on its stage (replicated ones on TP rank 0 only, dense ones on EP rank 0
    only; the tied output copy never, it is a replica of the embedding), then the same boxes
    for each optimizer state. Buffers have no optimizer state."""
    tp_rank, pp_rank, ep_rank = rank
    padded = spec.padded_vocab_size(layout.tp)
    out: list[TargetChunk] = []
    # TE's parameter order (megatron-core saves by key, so the order only fixes the files');
    # the local spec's split of MLA's down projections, which is not TE's.
    params = rank_params(spec, layout, pp_rank, ep_rank=ep_rank)
    if naming is Naming.LOCAL and spec.mla is not None:
        params = [local_split(rp) for rp in params]
    for prefix_state in (None, *states):
        for rp in params:
            param = rp.param
            if rp.tied_copy or (prefix_state and param.buffer):
                continue
            if param.expert is None:
                if ep_rank != 0 or (param.split is Split.REPLICATED and tp_rank != 0):
                    continue
                shards = [(layout.tp, tp_rank)]
            else:
                # Expert TP ranks need not match the dense ones: this file takes the expert
                # shards whose ETP rank falls to its TP rank (any file may hold any chunk).
                etp = layout.expert_tp
                mine = [r for r in range(etp) if r % layout.tp == tp_rank]
                if param.split is Split.REPLICATED:
                    mine = [0] if tp_rank == 0 else []
                shards = [(etp, r) for r in mine]
            for size, shard_rank in shards:
                out.extend(
                    _chunks(spec, layout, param, (size, shard_rank), prefix_state, naming, padded)
                )
    return out


def _chunks(
    spec: ModelSpec,
    layout: ParallelLayout,
    param: Param,
    shard: tuple[int, int],
    prefix_state: str | None,
    naming: Naming,
    padded: int,
) -> list[TargetChunk]:
    """The boxes of one TP (or expert TP) shard of ``param`` (or of its optimizer state)."""
    size, shard_rank = shard
    local, pieces = shard_shape_and_pieces(
        param.split, param.shape, size, shard_rank, padded, param.parts
    )
    key = torch_dist_key(param, naming, spec.mla is not None, numbered_layers(spec))
    if prefix_state is not None:
        key = optimizer_key(prefix_state, key, param, layout)
    canonical = state_name(prefix_state, param.name) if prefix_state else param.name
    if param.split is Split.VOCAB:
        # The whole padded slice; rows past the vocabulary are in no piece (zeros).
        boxes = [((shard_rank * local[0], *(0,) * (len(local) - 1)), local, pieces)]
    else:
        boxes = [
            (p.canonical, p.sizes, (Piece((0,) * len(p.sizes), p.canonical, p.sizes),))
            for p in pieces
        ]
    lead = _leading(param, spec)
    return [
        TargetChunk(
            fqn=_part_key(key, param, offsets),
            global_shape=_part_shape(global_shape(param, spec, layout.tp), param, offsets),
            offsets=(*lead, *_part_offsets(param, offsets)),
            sizes=(*(1,) * len(lead), *sizes),
            canonical=canonical,
            local_shape=tuple(sizes),
            pieces=box_pieces,
        )
        for offsets, sizes, box_pieces in boxes
    ]


def _part_index(param: Param, row: int) -> int:
    """The part of a ``Split.PARTS`` parameter that canonical row ``row`` lies in."""
    start = 0
    for index, size in enumerate(param.parts):
        if row < start + size:
            return index
        start += size
    raise AssertionError((param.name, row))


def _part_key(key: str, param: Param, offsets: Shape) -> str:
    """A box of a parameter saved in parts lies in one part, which has a key of its own."""
    if not param.parts:
        return key
    layer = layer_parts(param.name)
    assert layer is not None
    return f"{key}.{PART_NAMES[layer[1]][_part_index(param, offsets[0])]}"


def _part_shape(shape: Shape, param: Param, offsets: Shape) -> Shape:
    if not param.parts:
        return shape
    rows = param.parts[_part_index(param, offsets[0])]
    lead = len(shape) - len(param.shape)
    return (*shape[:lead], rows, *shape[lead + 1 :])


def _part_offsets(param: Param, offsets: Shape) -> Shape:
    if not param.parts:
        return offsets
    index = _part_index(param, offsets[0])
    return (offsets[0] - sum(param.parts[:index]), *offsets[1:])


def _leading(param: Param, spec: ModelSpec) -> tuple[int, ...]:
    """Offsets of a parameter's chunks in the stacked dimensions: layer, then expert (no layer
    dimension where dense and MoE layers mix, or in an MTP layer: each has keys of its own)."""
    layers = (param.layer,) if _stacked(param, spec) and param.layer is not None else ()
    return layers if param.expert is None else (*layers, param.expert)


MCORE_METADATA_TEXT = json.dumps(
    {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
)


def torch_dist_files(
    spec: ModelSpec,
    layout: ParallelLayout,
    iteration_dir: str,
    weight_dtype: str,
    states: tuple[str, ...],
    naming: Naming = Naming.TE,
) -> tuple[StoredFile, ...]:
    """One ``.distcp`` file per model-parallel rank (DP rank 0 saves the main replicas; under
    expert parallelism each EP rank saves its experts), named ``__<rank>_0.distcp`` with
    Megatron's global rank order (tp, then ep inside dp, then pp). Optimizer state is fp32."""
    files = []
    # Ranks per stage: tp * dp, or tp * ep files where expert parallelism spans TP ranks too
    # (ep > dp with expert TP 1): file names must not repeat from one stage to the next.
    per_stage = layout.tp * max(layout.dp, layout.ep)
    for pp_rank in range(layout.pp):
        for ep_rank in range(layout.ep):
            for tp_rank in range(layout.tp):
                rank = pp_rank * per_stage + ep_rank * layout.tp + tp_rank
                where = (tp_rank, pp_rank, ep_rank)
                tensors = tuple(
                    StoredTensor(
                        (c.fqn, *c.offsets),
                        c.canonical,
                        c.local_shape,
                        "float32" if "/" in c.canonical else weight_dtype,
                        c.pieces,
                    )
                    for c in rank_chunks(spec, layout, where, states, naming)
                )
                path = f"__{rank}_0.distcp"
                path = f"{iteration_dir}/{path}" if iteration_dir else path
                files.append(StoredFile(path, tensors, (tp_rank, pp_rank), ep_rank=ep_rank))
    return tuple(files)


def record_geometry(
    fqn: str, canonical: str, local_shape: Shape, spec: ModelSpec, tp: int
) -> tuple[Shape, Shape]:
    """Global shape of ``fqn`` and the shape of one chunk record (with its layer dimension)."""
    _, key = split_key(fqn)
    name = canonical.split("/", 1)[-1]
    param = model_catalog(spec)[name]
    stacked = is_stacked(key) or _numbered_experts(key) is not None
    lead = (1,) * len(_leading(param, spec)) if stacked else ()
    shape = global_shape(param, spec, tp)
    if param.parts:  # the part the key names
        start = _part_of(key, model_catalog(spec))[1]
        shape = _part_shape(shape, param, (start,))
    return shape, (*lead, *local_shape)
