"""Where every tensor of a Megatron legacy checkpoint lives, derived from spec and layout. Pure.

One ``model_optim_rng.pt`` per (tp, pp) rank holds that rank's model chunk(s) under local layer
indices (``model`` or ``model0..N`` under virtual pipeline) and, without the distributed
optimizer, the torch optimizer state keyed by parameter index in Megatron's parameter-group order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from math import prod

from ckptctl.errors import LayoutError
from ckptctl.formats.megatron_common.distopt_layout import replay_buffer
from ckptctl.formats.megatron_common.ranks import RankCoords, saving_ranks
from ckptctl.model.catalog import (
    EXPERTS,
    LAYER_PREFIX,
    MLA_DOWN_PROJECTIONS,
    MTP_PREFIX,
    ExpertNaming,
    Naming,
    Param,
    Stage,
    expert_block,
    expert_name,
    expert_suffixes,
    layer_kind,
    layer_kinds,
    layer_suffixes,
    local_layer_name,
    local_spec_order,
    mtp_head_suffixes,
    mtp_layer_prefix,
    mtp_tail_suffixes,
    parameters,
    parameters_by_name,
    stage_parameters,
    state_name,
    suffix_order,
)
from ckptctl.model.geometry import Piece, Shape, Split, shard_shape_and_pieces
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import GroupOrder, OptimizerLayout
from ckptctl.model.stored import KeyPath, StoredFile, StoredTensor

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
DISTOPT_FILE = "distrib_optim.pt"
DISTOPT_STATES = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""``distrib_optim.pt`` state names -> canonical optimizer state names."""
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"
MTP_LEGACY_INNER = "mtp_model_layer"
"""What megatron-core (0.17 on) names an MTP layer's transformer layer in legacy files; before,
and in ``torch_dist`` keys always, it is ``transformer_layer`` (``catalog.MTP_INNER``)."""
_SCALAR = (Piece((), (), ()),)


def iteration_dir(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


@dataclass(frozen=True, slots=True)
class RankParam:
    param: Param
    model_key: str
    """``model`` or ``model<c>``."""
    local_name: str
    tied_copy: bool = False
    block: int = 0
    """This parameter's block of a stored parameter that holds ``blocks`` local experts
    (``GroupedMLP``); the blocks of one stored parameter follow each other in the list."""
    blocks: int = 1


def stored_tensor(
    rp: RankParam,
    key: KeyPath,
    canonical: str,
    shape: Shape,
    dtype: str,
    pieces: tuple[Piece, ...],
    at: int | None = None,
) -> StoredTensor:
    """The stored tensor at ``key`` holding ``canonical`` (``rp``'s weight or optimizer state):
    the whole tensor there, or its flat slice from ``at``; under ``GroupedMLP`` the parameter's
    block, transposed, of the grouped tensor (or of its slice of a flat buffer)."""
    if rp.blocks == 1:
        return StoredTensor(key, canonical, shape, dtype, pieces, view_offset=at)
    offset = rp.block * prod(shape)
    if at is not None:
        return StoredTensor(key, canonical, shape, dtype, pieces, at + offset, transposed=True)
    # weight1 is [hidden, n * fc1 rows], weight2 [n * fc2 columns, hidden]: each block is a
    # contiguous run of elements, the expert's shard transposed.
    rows, columns = shape
    grouped = (
        (columns, rp.blocks * rows) if rp.local_name.endswith("1") else (rp.blocks * columns, rows)
    )
    return StoredTensor(
        key, canonical, shape, dtype, pieces, offset, transposed=True, base_shape=grouped
    )


def default_layer_order(spec: ModelSpec, naming: Naming) -> tuple[str, ...]:
    """A layer's parameters (TE spelling) in megatron-core's ``named_parameters`` order for
    the layer spec that ``naming`` belongs to."""
    suffixes = suffix_order(spec)
    return tuple(local_spec_order(suffixes) if naming is Naming.LOCAL else suffixes)


def rank_params(
    spec: ModelSpec,
    layout: ParallelLayout,
    pp_rank: int,
    naming: Naming = Naming.TE,
    layer_order: tuple[str, ...] | None = None,
    ep_rank: int = 0,
    expert_naming: ExpertNaming = ExpertNaming.SEQUENTIAL,
    mtp_inner: str = MTP_LEGACY_INNER,
) -> list[RankParam]:
    """The parameters a pipeline stage (and EP rank) holds, in ``named_parameters`` order
    over its chunks; parameters and persistent buffers alike (``Param.buffer`` tells).
    ``mtp_inner`` is the module the files keep an MTP layer's transformer layer under."""
    # Cached per spec: a large model's catalog is built once, not once per rank file.
    by_name = parameters_by_name(spec)
    order = layer_order or default_layer_order(spec, naming)
    experts = layout.local_experts(spec, ep_rank)
    expert_parts = [s for s, _, _ in expert_suffixes(spec)] if spec.is_moe else []
    chunks = layout.chunk_layers(spec.num_layers)
    last_stage, last_chunk = layout.pp - 1, layout.vpp - 1
    mla = spec.mla is not None
    # A model of dense and MoE layers: each layer takes the suffixes of its kind from the order.
    kinds = {kind: {s for s, _, _ in layer_suffixes(spec, *kind)} for kind in layer_kinds(spec)}

    def layer(
        prefix: str, local_prefix: str, kind: tuple[bool, bool], model_key: str
    ) -> list[RankParam]:
        out: list[RankParam] = []
        for suffix in order:
            if suffix not in kinds[kind]:
                continue
            if suffix == EXPERTS:
                grouped = expert_naming is ExpertNaming.GROUPED
                out.extend(
                    RankParam(
                        by_name[expert_name(prefix, e, part)],
                        model_key,
                        local_prefix + name,
                        block=e - experts.start if grouped else 0,
                        blocks=len(experts) if grouped else 1,
                    )
                    for part, e, name in expert_block(expert_parts, experts, expert_naming)
                )
                continue
            param = by_name[prefix + suffix]
            if naming is Naming.LOCAL and suffix in MLA_DOWN_PROJECTIONS:
                if param.shape[0] % layout.tp:
                    raise LayoutError(
                        f"tp={layout.tp} does not divide the {param.shape[0]} rows of "
                        f"{suffix}, which the local spec splits over TP"
                    )
                param = replace(param, split=Split.COLUMN)  # see MLA_DOWN_PROJECTIONS
            name = f"{local_prefix}{local_layer_name(suffix, naming, mla)}"
            out.append(RankParam(param, model_key, name))
        return out

    def mtp(model_key: str) -> list[RankParam]:
        out: list[RankParam] = []
        for k in range(spec.mtp_num_layers):
            head = f"{MTP_PREFIX}{k}."
            out.extend(
                RankParam(by_name[head + s], model_key, head + s)
                for s, _, _ in mtp_head_suffixes(spec)
            )
            out.extend(
                layer(
                    mtp_layer_prefix(k),
                    mtp_layer_prefix(k, mtp_inner),
                    (spec.mtp_is_moe, False),
                    model_key,
                )
            )
            out.extend(
                RankParam(by_name[head + s], model_key, head + s)
                for s, _, _ in mtp_tail_suffixes(spec)
            )
        return out

    out: list[RankParam] = []
    for chunk in range(layout.vpp):
        model_key = "model" if layout.vpp == 1 else f"model{chunk}"
        first = pp_rank == 0 and chunk == 0
        last = pp_rank == last_stage and chunk == last_chunk
        if first:
            out.extend(RankParam(p, model_key, p.name) for p in stage_parameters(spec, Stage.FIRST))
        elif last and spec.mtp_num_layers:
            # MTP layers embed the tokens too: the last stage keeps a copy of the embedding,
            # registered first, as megatron-core's GPTModel builds it there.
            embedding = by_name[EMBEDDING]
            out.append(RankParam(embedding, model_key, EMBEDDING, tied_copy=True))
        for local, number in enumerate(chunks[(pp_rank, chunk)]):
            prefix, local_prefix = f"{LAYER_PREFIX}{number}.", f"{LAYER_PREFIX}{local}."
            out.extend(layer(prefix, local_prefix, layer_kind(spec, number), model_key))
        if last:
            tail = stage_parameters(spec, Stage.LAST)
            decoder = [p for p in tail if p.name.startswith("decoder.")]
            out.extend(RankParam(p, model_key, p.name) for p in decoder)
            out.extend(mtp(model_key))
            out.extend(RankParam(p, model_key, p.name) for p in tail if p not in decoder)
            # With MTP the output layer uses the last stage's embedding copy (no weight of its own).
            if spec.tie_embeddings and layout.pp > 1 and not spec.mtp_num_layers:
                embedding = by_name[EMBEDDING]
                out.append(RankParam(embedding, model_key, TIED_OUTPUT, tied_copy=True))
    return out


@lru_cache(maxsize=32)
def group_kinds(spec: ModelSpec, experts: bool) -> frozenset[bool]:
    """The parameter-group kinds (no weight decay?) the dense optimizer, or the experts',
    has anywhere in the model."""
    return frozenset(
        p.no_weight_decay
        for p in parameters(spec)
        if not p.buffer and (p.expert is not None) is experts
    )


def sub_optimizers(params: list[RankParam], chained: bool) -> list[list[int]]:
    """Positions (in ``params``) of the parameters each sub-optimizer holds: all of them, or
    under a chained optimizer the dense ones then the routed experts'. Buffers hold none; a
    grouped parameter is one, at the position of its first block."""
    trained = [pos for pos, rp in enumerate(params) if not rp.param.buffer and rp.block == 0]
    if not chained:
        return [trained]
    dense = [pos for pos in trained if params[pos].param.expert is None]
    return [dense, [pos for pos in trained if params[pos].param.expert is not None]]


def param_groups(
    params: list[RankParam],
    order: GroupOrder = GroupOrder.APPEARANCE,
    members: list[int] | None = None,
    aligned: frozenset[bool] = frozenset(),
) -> list[tuple[bool, list[int]]]:
    """Megatron's default grouping of one optimizer's parameters (``members``, positions in
    ``params``; default: all but buffers): per group, its kind (no weight decay?) and the
    positions of its parameters in model order. The torch optimizer numbers parameters group
    after group. Megatron-Core (0.15 on) gives every rank the groups of every rank: an
    optimizer without parameters here (the expert optimizer of a stage without MoE layers)
    has the groups of ``aligned``, the kinds it has anywhere in the model, empty."""
    groups: dict[bool, list[int]] = {}
    if members is None:
        members = sub_optimizers(params, chained=False)[0]
    for pos in members:
        groups.setdefault(params[pos].param.no_weight_decay, []).append(pos)
    if not members:
        groups = {kind: [] for kind in sorted(aligned)}
    kinds = list(groups)
    if order is GroupOrder.DECAY_FIRST:
        kinds.sort()
    return [(kind, groups[kind]) for kind in kinds]


def optimizer_index(groups: list[tuple[bool, list[int]]]) -> dict[int, tuple[int, int, int]]:
    """Parameter position -> (torch state index, group, position within group)."""
    out, index = {}, 0
    for g, (_, members) in enumerate(groups):
        for i, pos in enumerate(members):
            out[pos] = (index, g, i)
            index += 1
    return out


def megatron_files(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    iteration: int | None,
    weight_dtype: str,
    optimizer: OptimizerLayout | None,
    naming: Naming = Naming.TE,
    layer_order: tuple[str, ...] | None = None,
    expert_naming: ExpertNaming = ExpertNaming.SEQUENTIAL,
    mtp_inner: str = MTP_LEGACY_INNER,
) -> tuple[StoredFile, ...]:
    """Every rank file of a Megatron legacy checkpoint and the tensors it holds: one per
    saving rank (``ranks.saving_ranks``), each with the dense parameters of its (tp, pp) shard
    and its EP rank's experts, split over expert TP."""
    layout.check_against(spec)
    if expert_naming is ExpertNaming.GROUPED and spec.add_bias_linear and spec.is_moe:
        raise LayoutError(
            "args.moe_grouped_gemm without TransformerEngine (GroupedMLP) with add_bias_linear: "
            "megatron-core's GroupedMLP has no biases; save with --disable-bias-linear"
        )
    padded = spec.padded_vocab_size(layout.tp)
    files = []
    # The files of every EP rank of one (tp, expert tp, pp) shard hold the same dense tensors
    # at the same positions and keys (each EP rank has as many local experts): they are built
    # once and shared (frozen objects), so a 64-way expert-parallel checkpoint costs its dense
    # tensors once, not 64 times.
    dense_of: dict[tuple[int, int, int, int], _DenseShard] = {}
    for saver in saving_ranks(layout):
        tp_rank, pp_rank, ep_rank = saver.tp, saver.pp, saver.ep
        params = rank_params(
            spec, layout, pp_rank, naming, layer_order, ep_rank, expert_naming, mtp_inner
        )
        dense = dense_of.setdefault((tp_rank, saver.etp, pp_rank, len(params)), _DenseShard())
        tensors: list[StoredTensor] = []
        geometry = []
        for pos, rp in enumerate(params):
            known = dense.weights.get(pos) if rp.param.expert is None else None
            if known is not None:
                geometry.append(known[1])
                tensors.append(known[0])
                continue
            # Experts are split over expert TP, the rest over TP.
            tp, rank = (
                (layout.tp, tp_rank) if rp.param.expert is None else (layout.expert_tp, saver.etp)
            )
            param = rp.param
            shape, pieces = shard_shape_and_pieces(
                param.split, param.shape, tp, rank, padded, param.parts
            )
            geometry.append((shape, pieces))
            # megatron-core keeps the router's expert bias in fp32 whatever the weights' dtype.
            dtype = "float32" if rp.param.buffer else weight_dtype
            key = (rp.model_key, rp.local_name)
            tensors.append(stored_tensor(rp, key, rp.param.name, shape, dtype, pieces))
            if rp.param.expert is None:
                dense.weights[pos] = (tensors[-1], (shape, pieces))
        rank_path = f"{iteration_dir(iteration)}/{saver.directory(layout)}"
        if optimizer is not None and optimizer.distributed:
            files.append(
                distopt_file(
                    f"{rank_path}/{DISTOPT_FILE}",
                    params,
                    geometry,
                    layout,
                    saver,
                    optimizer,
                    weight_dtype,
                    spec.tie_embeddings,
                )
            )
        elif optimizer is not None:
            tensors.extend(_optimizer_tensors(params, geometry, optimizer, dense.states))
        files.append(
            StoredFile(
                f"{rank_path}/{RANK_FILE}", tuple(tensors), (tp_rank, pp_rank), ep_rank=ep_rank
            )
        )
    # Rank files first (their tracker-bearing order), then distributed-optimizer files.
    return tuple(sorted(files, key=lambda f: f.path.endswith(DISTOPT_FILE)))


@dataclass
class _DenseShard:
    """What the files of one dense shard share (``megatron_files``), by parameter position:
    each dense weight's tensor and geometry, each dense parameter's optimizer state tensors."""

    weights: dict[int, tuple[StoredTensor, tuple[Shape, tuple[Piece, ...]]]] = field(
        default_factory=dict
    )
    states: dict[int, list[StoredTensor]] = field(default_factory=dict)


def _optimizer_tensors(
    params: list[RankParam],
    geometry: list[tuple[tuple[int, ...], tuple[Piece, ...]]],
    optimizer: OptimizerLayout,
    dense: dict[int, list[StoredTensor]],
) -> list[StoredTensor]:
    """Per-parameter torch optimizer state (and fp32 masters) of one rank file, sub-optimizer
    by sub-optimizer, each numbering its parameters group after group; a dense parameter's
    tensors are taken from ``dense`` (another EP rank's file of the shard) once built."""
    tensors: list[StoredTensor] = []
    # Hot for the largest plans (hundreds of thousands of tensors): paths hoisted, and the
    # common case (a parameter stored whole) built without the helper.
    for sub, members in enumerate(sub_optimizers(params, optimizer.chained)):
        groups = param_groups(params, optimizer.group_order, members)
        state_path, sub_path = optimizer.sub_state(sub), optimizer.sub(sub)
        for first, (index, g, i) in sorted(optimizer_index(groups).items()):
            if params[first].param.expert is None and first in dense:
                tensors.extend(dense[first])
                continue
            built = len(tensors)
            for pos in range(first, first + params[first].blocks):
                rp, (shape, pieces) = params[pos], geometry[pos]
                name = rp.param.name
                for state in optimizer.states:
                    key: KeyPath = (*state_path, "state", index, state)
                    canonical = state_name(state, name)
                    if state == "step":  # one step per stored parameter
                        if rp.block == 0:
                            tensors.append(StoredTensor(key, canonical, (), "float32", _SCALAR))
                    elif rp.blocks == 1:
                        tensors.append(StoredTensor(key, canonical, shape, "float32", pieces))
                    else:
                        tensors.append(stored_tensor(rp, key, canonical, shape, "float32", pieces))
                if optimizer.master_weights:
                    key = (*sub_path, "fp32_from_fp16_params", g, i)
                    canonical = state_name("fp32_param", name)
                    tensors.append(stored_tensor(rp, key, canonical, shape, "float32", pieces))
            if params[first].param.expert is None:
                dense[first] = tensors[built:]
    return tensors


def distopt_dtype_key(weight_dtype: str, grad_dtype: str | None = None) -> str:
    """Name of the ``(param dtype, grad dtype)`` key of a grad buffer: grads reduce in fp32
    unless the run reduced them in its 16-bit dtype (fp32 weights always reduce in fp32)."""
    grad = grad_dtype if grad_dtype and weight_dtype != "float32" else "float32"
    return f"{weight_dtype}|{grad}"


def effective_bucket_size(
    optimizer: OptimizerLayout, dp: int, pp_rank: int, chunk: int
) -> int | None:
    """Megatron buckets only the first chunk of the first stage, and only with overlap on."""
    if not optimizer.overlap_grad_reduce or pp_rank > 0 or chunk > 0:
        return None
    return optimizer.bucket_size or max(40_000_000, 1_000_000 * dp)


def distopt_file(
    path: str,
    params: list[RankParam],
    geometry: list[tuple[tuple[int, ...], tuple[Piece, ...]]],
    layout: ParallelLayout,
    saver: RankCoords,
    optimizer: OptimizerLayout,
    weight_dtype: str,
    tied: bool,
) -> StoredFile:
    """``distrib_optim.pt``: one grad buffer per model chunk, its state as flat fp32 tensors.

    Under a chained optimizer (EP > 1) the file is a list of the two optimizers' states: the
    dense one sharded over DP (kept only by the files of DP rank 0: with expert TP equal to TP,
    EP rank 0's), the expert one over expert DP."""
    tp_rank, pp_rank, ep_rank = saver.tp, saver.pp, saver.ep
    tensors: list[StoredTensor] = []
    flat: list[tuple[KeyPath, int]] = []
    buckets: list[tuple[KeyPath, tuple[int, ...]]] = []
    for sub, members in enumerate(sub_optimizers(params, optimizer.chained)):
        if optimizer.chained and sub == 0 and saver.dp != 0:
            continue
        dp = layout.expert_dp if sub == 1 else layout.dp
        prefix: KeyPath = (sub,) if optimizer.chained else ()
        chunks = list(dict.fromkeys(params[i].model_key for i in members))
        for gbuf, model_key in enumerate(chunks):
            in_chunk = [i for i in members if params[i].model_key == model_key]
            shared = None
            if tied and layout.pp > 1:
                shared = next(
                    (
                        params[i].local_name
                        for i in in_chunk
                        if params[i].param.name == "embedding.word_embeddings.weight"
                    ),
                    None,
                )
            entries = [
                (params[i].local_name, params[i].blocks * _numel(geometry[i][0])) for i in in_chunk
            ]
            buffer = replay_buffer(
                entries,
                dp=dp,
                bucket_size=effective_bucket_size(optimizer, dp, pp_rank, gbuf),
                shared_embedding=shared,
            )
            dtype_key = distopt_dtype_key(weight_dtype, optimizer.grad_dtype)
            for stored_state, canonical_state in DISTOPT_STATES.items():
                key: KeyPath = (*prefix, gbuf, dtype_key, stored_state)
                flat.append((key, buffer.numel_unpadded))
                buckets.append((key, buffer.bucket_unpadded))
                for first in in_chunk:
                    at = buffer.offsets[params[first].local_name]
                    for i in range(first, first + params[first].blocks):
                        shape, pieces = geometry[i]
                        canonical = state_name(canonical_state, params[i].param.name)
                        tensors.append(
                            stored_tensor(params[i], key, canonical, shape, "float32", pieces, at)
                        )
    rank = (tp_rank, pp_rank)
    return StoredFile(path, tuple(tensors), rank, tuple(flat), ep_rank, tuple(buckets))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def tracker_text(iteration: int | None) -> str:
    return "release" if iteration is None else str(iteration)
