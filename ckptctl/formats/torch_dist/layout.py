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

from ckptctl.formats.megatron.distopt_layout import CHAINED
from ckptctl.formats.megatron.layout import RankParam, rank_params
from ckptctl.model.catalog import (
    EXPERTS,
    LAYER_PREFIX,
    MLA_DOWN_PROJECTIONS,
    MTP_INNER,
    MTP_PREFIX,
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
        param = _param_of(name, catalog)
        if param is None or len(param.shape) != len(inner_sizes):
            return None
        clipped = tuple(
            max(0, min(o + n, limit) - o)
            for o, n, limit in zip(inner_offsets, inner_sizes, param.shape, strict=True)
        )
        pieces = (Piece((0,) * len(clipped), inner_offsets, clipped),) if all(clipped) else ()
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


def _stacked(param: Param, spec: ModelSpec) -> bool:
    """Whether ``param``'s key has a leading layer dimension (homogeneous decoder layers)."""
    return param.layer is not None and not spec.dense_layers


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
    local, pieces = shard_shape_and_pieces(param.split, param.shape, size, shard_rank, padded)
    key = torch_dist_key(param, naming, spec.mla is not None, bool(spec.dense_layers))
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
            fqn=key,
            global_shape=global_shape(param, spec, layout.tp),
            offsets=(*lead, *offsets),
            sizes=(*(1,) * len(lead), *sizes),
            canonical=canonical,
            local_shape=tuple(sizes),
            pieces=box_pieces,
        )
        for offsets, sizes, box_pieces in boxes
    ]


def _leading(param: Param, spec: ModelSpec) -> tuple[int, ...]:
    """Offsets of a parameter's chunks in the stacked dimensions: layer, then expert (no layer
    dimension where dense and MoE layers mix, or in an MTP layer: each has keys of its own)."""
    layers = (param.layer,) if _stacked(param, spec) and param.layer is not None else ()
    return layers if param.expert is None else (*layers, param.expert)


MCORE_METADATA = "metadata.json"
MCORE_METADATA_TEXT = json.dumps(
    {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
)
COMMON = "common.pt"


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
    for pp_rank in range(layout.pp):
        for ep_rank in range(layout.ep):
            for tp_rank in range(layout.tp):
                rank = pp_rank * layout.tp * layout.dp + ep_rank * layout.tp + tp_rank
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
    return global_shape(param, spec, tp), (*lead, *local_shape)


EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "self_attention.core_attention",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
"""Layer modules whose ``_extra_state`` (TransformerEngine FP8 metadata) Megatron-Core asks for
when loading: written empty, as Megatron-Core itself writes it without FP8, so strict loads find
every key (``core_attention`` only TE layers ask for; others ignore it as unexpected). An MoE
layer has shared experts' linears instead of ``mlp.linear_fc*``, and per-expert linears whose
extra state is an ``(L, E)`` grid."""


_MLA_QUERIES = ("linear_q_down_proj", "linear_q_up_proj")
"""Multi-latent attention's linears in place of ``linear_qkv`` (``linear_q_proj`` when queries
are not compressed)."""


def _extra_state_modules(spec: ModelSpec, moe: bool) -> tuple[str, ...]:
    modules: tuple[str, ...] = EXTRA_STATE_MODULES
    if spec.mla is not None:
        queries = ("linear_q_proj",) if spec.mla.q_lora_rank is None else _MLA_QUERIES
        attention = (*queries, "linear_kv_down_proj", "linear_kv_up_proj")
        modules = (*(f"self_attention.{m}" for m in attention), *modules[1:])
    if moe:
        modules = modules[: len(modules) - 2]
        if spec.moe_shared_expert_intermediate_size:
            modules += ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
    return modules


def mtp_extra_state_keys(
    spec: ModelSpec, experts: range = range(0), dense: bool = True
) -> list[str]:
    """Empty ``_extra_state`` items of the MTP layers (their projection, their transformer
    layer's modules and its ``experts``), keyed like a numbered layer's."""
    keys: list[str] = []
    total = spec.num_experts or 0
    modules = _extra_state_modules(spec, spec.mtp_is_moe)
    for k in range(spec.mtp_num_layers):
        head, inner = f"{MTP_PREFIX}{k}.", f"{MTP_PREFIX}{k}.{MTP_INNER}."
        if dense:
            keys.append(f"{head}eh_proj._extra_state/shard_0_1")
            keys.extend(f"{inner}{module}._extra_state/shard_0_1" for module in modules)
        if spec.mtp_is_moe:
            keys.extend(
                f"{inner}{EXPERTS_KEY}{linear}._extra_state/shard_{expert}_{total}"
                for expert in experts
                for linear in ("linear_fc1", "linear_fc2")
            )
    return keys


def extra_state_keys(
    spec: ModelSpec, layers: list[int], experts: range = range(0), dense: bool = True
) -> list[str]:
    """Empty ``_extra_state`` items of ``layers``: the dense modules' (``dense``) and the
    ``experts``' own."""
    kinds = {moe: _extra_state_modules(spec, moe) for moe in (False, spec.is_moe)}
    keys: list[str] = []
    total_experts = spec.num_experts or 0
    linears = ("linear_fc1", "linear_fc2")
    for layer in layers:
        moe = spec.is_moe_layer(layer)
        if spec.dense_layers:  # dense and MoE layers mixed: each layer keyed by its number
            prefix = f"{LAYER_PREFIX}{layer}."
            if dense:
                keys.extend(f"{prefix}{module}._extra_state/shard_0_1" for module in kinds[moe])
            if moe:
                keys.extend(
                    f"{prefix}{EXPERTS_KEY}{linear}._extra_state/shard_{expert}_{total_experts}"
                    for expert in experts
                    for linear in linears
                )
            continue
        if dense:
            keys.extend(
                f"{LAYER_PREFIX}{module}._extra_state/shard_{layer}_{spec.num_layers}"
                for module in kinds[moe]
            )
        if moe:
            keys.extend(
                f"{LAYER_PREFIX}{EXPERTS_KEY}{linear}._extra_state/"
                f"shard_{layer}.{expert}_{spec.num_layers}.{total_experts}"
                for expert in experts
                for linear in linears
            )
    return keys
