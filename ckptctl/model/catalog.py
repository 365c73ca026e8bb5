"""The parameter catalog of the GPT/Llama decoder family and its split rules.

Canonical names are Megatron-Core's (TransformerEngine spec) with the *global* layer index; a
canonical tensor is the full, TP-merged tensor with the vocabulary trimmed to its true size.
Optimizer state shares its parameter's geometry under ``<state>/<parameter>``. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from ckptctl.model.geometry import Shape, Split
from ckptctl.model.layout import ModelSpec, NormKind, PositionEmbedding
from ckptctl.model.linear_attention import gdn_attention, is_linear_layer, parts_of
from ckptctl.model.mla import mla_attention


class Stage(StrEnum):
    """Where a parameter lives in the pipeline."""

    FIRST = "first"
    """First stage, first virtual chunk (embeddings)."""
    LAYER = "layer"
    """The stage and chunk owning the transformer layer."""
    LAST = "last"
    """Last stage, last virtual chunk (final norm, output layer)."""
    MTP = "mtp"
    """Last stage, last virtual chunk, between the final norm and the output layer: the
    multi-token prediction layers."""


class Naming(StrEnum):
    """Megatron-Core's two layer specs name the pre-attention/pre-MLP norms differently."""

    TE = "te"
    """TransformerEngine fused names: ``linear_qkv.layer_norm_weight``."""
    LOCAL = "local"
    """Local spec names: ``input_layernorm.weight``, ``pre_mlp_layernorm.weight``."""


OPTIMIZER_STATES = ("fp32_param", "exp_avg", "exp_avg_sq", "step")
"""Per-parameter optimizer state kept beside each weight (Adam with fp32 master weights)."""


def is_state(canonical: str) -> bool:
    """Whether a canonical tensor is optimizer state (``STATE/PARAM``): Adam's, or any torch
    optimizer's (SGD's ``momentum_buffer``); parameter names hold no ``/``."""
    return "/" in canonical


_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_LOCAL_TO_TE = {local: te for te, local in _TE_TO_LOCAL.items()}
# Multi-latent attention: the input norm is its own module in both specs (the first linear is
# no fused layer-norm linear), and TE fuses the q / kv norms into the up projections.
_MLA_TE_TO_LOCAL = {
    f"self_attention.linear_{which}_up_proj.layer_norm_{kind}": (
        f"self_attention.{which}_layernorm.{kind}"
    )
    for which in ("q", "kv")
    for kind in ("weight", "bias")
}
_MLA_LOCAL_TO_TE = {local: te for te, local in _MLA_TE_TO_LOCAL.items()}
MLA_DOWN_PROJECTIONS = frozenset(
    {"self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight"}
)
"""Duplicated on every TP rank under TE (``TELinear``), column-parallel in the local spec
(``ColumnParallelLinear``, gathered in the forward)."""

LAYER_PREFIX = "decoder.layers."
MTP_PREFIX = "mtp.layers."
MTP_INNER = "transformer_layer"
"""The module an MTP layer's transformer layer is under in canonical names and in megatron-core's
sharded keys (every release); its legacy files name it ``mtp_model_layer`` since 0.17."""


def mtp_layer_prefix(k: int, inner: str = MTP_INNER) -> str:
    """Prefix of MTP layer ``k``'s transformer layer parameters."""
    return f"{MTP_PREFIX}{k}.{inner}."


def layer_parts(name: str) -> tuple[str, str] | None:
    """``(layer prefix, layer-relative suffix)`` of a canonical name of a decoder layer's or an
    MTP layer's transformer layer parameter; ``None`` for any other."""
    if name.startswith(LAYER_PREFIX):
        layer, _, suffix = name[len(LAYER_PREFIX) :].partition(".")
        return f"{LAYER_PREFIX}{layer}.", suffix
    if name.startswith(MTP_PREFIX):
        k, _, rest = name[len(MTP_PREFIX) :].partition(".")
        inner, _, suffix = rest.partition(".")
        if inner == MTP_INNER and suffix:
            return mtp_layer_prefix(int(k)), suffix
    return None


EXPERTS = "mlp.experts"
POST_ATTENTION_NORM = "self_attention.linear_proj.post_layernorm.weight"
POST_MLP_NORM = "mlp.linear_fc2.post_layernorm.weight"
"""Gemma 3's norms after attention and after the MLP, as Megatron-Bridge names them."""
"""Where a layer's routed experts sit among its parameters. Layer orders hold this one marker
for the whole expert block, because the block's own order depends on the expert module
(``ExpertNaming``) and its members on the EP rank."""


class ExpertNaming(StrEnum):
    """How megatron-core's expert modules name a layer's local experts."""

    SEQUENTIAL = "sequential"
    """``SequentialMLP``: ``mlp.experts.local_experts.<j>.linear_fc1.weight``, expert-major."""
    TE_GROUPED = "te_grouped"
    """``TEGroupedMLP`` (``--moe-grouped-gemm`` with TransformerEngine):
    ``mlp.experts.linear_fc1.weight<j>``, one grouped linear after the other."""
    GROUPED = "grouped"
    """``GroupedMLP`` (``--moe-grouped-gemm`` without TransformerEngine, or
    ``--moe-use-legacy-grouped-gemm``): every local expert's fc1 in one parameter
    ``mlp.experts.weight1`` ``[hidden, n_local * fc1 rows]`` viewed as ``[n_local, hidden, rows]``,
    fc2 in ``weight2`` ``[n_local * fc2 columns, hidden]``; each expert's block is its shard
    transposed (the grouped GEMM multiplies without transposing)."""


GROUPED_MLP_NAMES = {"linear_fc1.weight": "weight1", "linear_fc2.weight": "weight2"}
"""``GroupedMLP``'s parameters; it has no biases (megatron-core refuses ``add_bias_linear``)."""


def expert_name(layer_prefix: str, expert: int, suffix: str) -> str:
    """Canonical name of ``suffix`` (e.g. ``linear_fc1.weight``) of global ``expert``."""
    return f"{layer_prefix}{EXPERTS}.local_experts.{expert}.{suffix}"


def expert_of(canonical: str) -> int | None:
    """The global expert a canonical tensor (or its optimizer state) belongs to, if any."""
    marker = f".{EXPERTS}.local_experts."
    if marker not in canonical:
        return None
    return int(canonical.split(marker, 1)[1].split(".", 1)[0])


def stored_expert_name(suffix: str, local: int, naming: ExpertNaming) -> str:
    """Layer-relative stored name of ``suffix`` of local expert ``local``."""
    if naming is ExpertNaming.SEQUENTIAL:
        return f"{EXPERTS}.local_experts.{local}.{suffix}"
    if naming is ExpertNaming.GROUPED:  # one parameter for all local experts
        return f"{EXPERTS}.{GROUPED_MLP_NAMES[suffix]}"
    module, kind = suffix.split(".")
    return f"{EXPERTS}.{module}.{kind}{local}"


def expert_block(
    suffixes: list[str], experts: range, naming: ExpertNaming
) -> list[tuple[str, int, str]]:
    """(expert suffix, global expert, stored layer-relative name) of one layer's expert block,
    in the module's ``named_parameters`` order."""
    if naming is ExpertNaming.SEQUENTIAL:
        pairs = [(e, s) for e in experts for s in suffixes]
    else:  # grouped linears: each suffix (in expert_suffixes order) for every expert in turn
        pairs = [(e, s) for s in suffixes for e in experts]
    return [(s, e, stored_expert_name(s, e - experts.start, naming)) for e, s in pairs]


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    """Canonical name (global layer index, TE spec spelling)."""
    shape: Shape
    """Canonical shape: TP-merged, vocabulary unpadded."""
    split: Split
    stage: Stage
    layer: int | None = None
    expert: int | None = None
    """Global expert index of a routed expert's parameter (split over EP, then ETP)."""
    buffer: bool = False
    """A persistent buffer (the router's expert bias): stored, never optimised."""
    parts: Shape = ()
    """The part sizes of dim 0 of a ``Split.PARTS`` parameter."""

    @property
    def no_weight_decay(self) -> bool:
        """Megatron's default rule: biases and 1-D parameters get no weight decay."""
        return self.name.endswith(".bias") or len(self.shape) == 1


def expert_suffixes(spec: ModelSpec) -> list[tuple[str, Shape, Split]]:
    """One routed expert's parameters (a SwiGLU/GELU MLP of the expert FFN size)."""
    h, f = spec.hidden_size, spec.expert_ffn_size
    rows = 2 * f if spec.gated_linear_unit else f
    fc1_split = Split.GATED if spec.gated_linear_unit else Split.COLUMN
    out: list[tuple[str, Shape, Split]] = [("linear_fc1.weight", (rows, h), fc1_split)]
    if spec.add_bias_linear:
        out.append(("linear_fc1.bias", (rows,), fc1_split))
    out.append(("linear_fc2.weight", (h, f), Split.ROW))
    if spec.add_bias_linear:
        out.append(("linear_fc2.bias", (h,), Split.REPLICATED))
    return out


def _moe_mlp(spec: ModelSpec, layernorm: bool) -> list[tuple[str, Shape, Split]]:
    """An MoE layer's MLP part in megatron-core's order: its own norm module, router, the
    experts (one ``EXPERTS`` marker), shared experts (own gate parameter before its linears)."""
    h, e = spec.hidden_size, spec.num_experts or 0
    out: list[tuple[str, Shape, Split]] = [("pre_mlp_layernorm.weight", (h,), Split.REPLICATED)]
    if layernorm:
        out.append(("pre_mlp_layernorm.bias", (h,), Split.REPLICATED))
    out.append(("mlp.router.weight", (e, h), Split.REPLICATED))
    if spec.add_bias_linear:
        out.append(("mlp.router.bias", (e,), Split.REPLICATED))
    if spec.moe_router_expert_bias:
        out.append((ROUTER_EXPERT_BIAS, (e,), Split.REPLICATED))
    out.append((EXPERTS, (), Split.REPLICATED))
    shared = spec.moe_shared_expert_intermediate_size
    if shared:
        if spec.moe_shared_expert_gate:
            out.append(("mlp.shared_experts.gate_weight", (1, h), Split.REPLICATED))
        rows = 2 * shared if spec.gated_linear_unit else shared
        fc1_split = Split.GATED if spec.gated_linear_unit else Split.COLUMN
        out.append(("mlp.shared_experts.linear_fc1.weight", (rows, h), fc1_split))
        if spec.add_bias_linear:
            out.append(("mlp.shared_experts.linear_fc1.bias", (rows,), fc1_split))
        out.append(("mlp.shared_experts.linear_fc2.weight", (h, shared), Split.ROW))
        if spec.add_bias_linear:
            out.append(("mlp.shared_experts.linear_fc2.bias", (h,), Split.REPLICATED))
    return out


ROUTER_EXPERT_BIAS = "mlp.router.expert_bias"


def layer_suffixes(
    spec: ModelSpec, moe: bool | None = None, linear: bool = False
) -> list[tuple[str, Shape, Split]]:
    """Parameters of one transformer layer in Megatron-Core's registration order; an MoE
    layer's routed experts are the one ``EXPERTS`` entry (see ``expert_suffixes``). ``moe``
    says which kind of layer of a model with dense and MoE layers (default: the model's),
    ``linear`` whether a gated delta net layer."""
    moe = spec.is_moe if moe is None else moe
    h, d = spec.hidden_size, spec.kv_channels
    bias = spec.add_bias_linear
    layernorm = spec.normalization is NormKind.LAYERNORM
    if linear:
        return gdn_attention(spec) + _mlp(spec, layernorm, moe)
    if spec.mla is not None:
        return mla_attention(spec, layernorm) + _mlp(spec, layernorm, moe)
    out: list[tuple[str, Shape, Split]] = []
    if spec.attention_sinks:  # the core attention module is registered before linear_proj
        heads = (spec.num_attention_heads,)
        out.append(("self_attention.core_attention.softmax_offset", heads, Split.COLUMN))
    out.append(("self_attention.linear_proj.weight", (h, spec.num_attention_heads * d), Split.ROW))
    if bias:
        out.append(("self_attention.linear_proj.bias", (h,), Split.REPLICATED))
    out.append(("self_attention.linear_qkv.layer_norm_weight", (h,), Split.REPLICATED))
    if layernorm:
        out.append(("self_attention.linear_qkv.layer_norm_bias", (h,), Split.REPLICATED))
    out.append(("self_attention.linear_qkv.weight", (spec.qkv_rows, h), Split.COLUMN))
    if bias or spec.add_qkv_bias:
        out.append(("self_attention.linear_qkv.bias", (spec.qkv_rows,), Split.COLUMN))
    if spec.post_sublayer_norms:  # Megatron-Bridge's: a submodule of linear_proj, after it
        at = next(i for i, (s, _, _) in enumerate(out) if s.startswith("self_attention.linear_q"))
        out.insert(at, (POST_ATTENTION_NORM, (h,), Split.REPLICATED))
    if spec.qk_layernorm:
        # One norm over a head's kv_channels, shared by every head (TP-replicated).
        for which in ("q", "k"):
            out.append((f"self_attention.{which}_layernorm.weight", (d,), Split.REPLICATED))
            if layernorm:
                out.append((f"self_attention.{which}_layernorm.bias", (d,), Split.REPLICATED))
    return out + _mlp(spec, layernorm, moe)


def _mlp(spec: ModelSpec, layernorm: bool, moe: bool) -> list[tuple[str, Shape, Split]]:
    """A layer's MLP part: routed experts, or a dense MLP with the pre-MLP norm fused."""
    if moe:
        return _moe_mlp(spec, layernorm)
    h, bias = spec.hidden_size, spec.add_bias_linear
    out: list[tuple[str, Shape, Split]] = []
    fc1_split = Split.GATED if spec.gated_linear_unit else Split.COLUMN
    out.append(("mlp.linear_fc1.layer_norm_weight", (h,), Split.REPLICATED))
    if layernorm:
        out.append(("mlp.linear_fc1.layer_norm_bias", (h,), Split.REPLICATED))
    out.append(("mlp.linear_fc1.weight", (spec.fc1_rows, h), fc1_split))
    if bias:
        out.append(("mlp.linear_fc1.bias", (spec.fc1_rows,), fc1_split))
    out.append(("mlp.linear_fc2.weight", (h, spec.ffn_hidden_size), Split.ROW))
    if bias:
        out.append(("mlp.linear_fc2.bias", (h,), Split.REPLICATED))
    if spec.post_sublayer_norms:
        out.append((POST_MLP_NORM, (h,), Split.REPLICATED))
    return out


def suffix_order(spec: ModelSpec) -> list[str]:
    """One order for the layers of every kind (dense, MoE) of ``spec``: an MoE layer's, with
    a dense layer's MLP suffixes where its MLP part starts; each layer takes the suffixes it
    has, in this order."""
    suffixes = [s for s, _, _ in layer_suffixes(spec)]
    if spec.linear_attention is not None:  # its attention part first, then the layers' own
        gdn = [s for s, _, _ in layer_suffixes(spec, linear=True)]
        suffixes = [s for s in gdn if s not in suffixes] + suffixes
    if not spec.is_moe or not spec.dense_layers:
        return suffixes
    dense = [s for s, _, _ in layer_suffixes(spec, moe=False)]
    mlp = [s for s in dense if s not in suffixes]
    at = next(i for i, s in enumerate(suffixes) if s.startswith(("pre_mlp_layernorm.", "mlp.")))
    return suffixes[:at] + mlp + suffixes[at:]


def local_spec_order(suffixes: list[str]) -> list[str]:
    """TE-spelled layer suffixes in the local spec's ``named_parameters`` order: there the
    pre-attention norm is the layer's own first module (``input_layernorm``), not part of
    ``linear_qkv``; multi-latent attention's q / kv norms are modules registered after the
    projections; everything else keeps its place."""
    first = [s for s in suffixes if s.startswith("self_attention.linear_qkv.layer_norm_")]
    norms = [s for s in suffixes if s in _MLA_TE_TO_LOCAL]
    rest = [s for s in suffixes if s not in first and s not in norms]
    if norms:
        at = rest.index("self_attention.linear_kv_up_proj.weight") + 1
        rest[at:at] = norms
    return first + rest


def parameters(spec: ModelSpec) -> list[Param]:
    """Every canonical parameter of ``spec``, in model order."""
    return list(_parameters(spec))


@lru_cache(maxsize=8)
def parameters_by_name(spec: ModelSpec) -> dict[str, Param]:
    """Every canonical parameter of ``spec`` by name (shared: do not change it)."""
    return {p.name: p for p in _parameters(spec)}


@lru_cache(maxsize=32)
def stage_parameters(spec: ModelSpec, stage: Stage) -> tuple[Param, ...]:
    """The parameters of ``stage`` (embeddings first, final norm and output layer last)."""
    return tuple(p for p in _parameters(spec) if p.stage is stage)


@lru_cache(maxsize=8)
def _parameters(spec: ModelSpec) -> tuple[Param, ...]:
    h = spec.hidden_size
    params = [
        Param("embedding.word_embeddings.weight", (spec.vocab_size, h), Split.VOCAB, Stage.FIRST)
    ]
    if spec.position_embedding is PositionEmbedding.LEARNED:
        params.append(
            Param(
                "embedding.position_embeddings.weight",
                (spec.max_position_embeddings, h),
                Split.REPLICATED,
                Stage.FIRST,
            )
        )
    kinds = {kind: layer_suffixes(spec, *kind) for kind in layer_kinds(spec)}
    experts = expert_suffixes(spec) if spec.is_moe else []
    for layer in range(spec.num_layers):
        suffixes = kinds[layer_kind(spec, layer)]
        prefix = f"{LAYER_PREFIX}{layer}."
        params.extend(_layer_params(spec, prefix, suffixes, experts, Stage.LAYER, layer))
    params.extend(
        Param(f"decoder.{s}", shape, split, Stage.LAST)
        for s, shape, split in _norm("final_layernorm", spec)
    )
    for k in range(spec.mtp_num_layers):
        params.extend(_mtp_layer(spec, k, kinds[(spec.mtp_is_moe, False)], experts))
    if not spec.tie_embeddings:
        params.append(Param("output_layer.weight", (spec.vocab_size, h), Split.VOCAB, Stage.LAST))
    return tuple(params)


def _layer_params(
    spec: ModelSpec,
    prefix: str,
    suffixes: list[tuple[str, Shape, Split]],
    experts: list[tuple[str, Shape, Split]],
    stage: Stage,
    layer: int | None,
) -> list[Param]:
    """One transformer layer's parameters under ``prefix`` (a decoder layer's, an MTP
    layer's), the ``EXPERTS`` marker expanded into every routed expert's parameters."""
    out: list[Param] = []
    for suffix, shape, split in suffixes:
        if suffix == EXPERTS:
            out.extend(
                Param(expert_name(prefix, e, sub), sub_shape, sub_split, stage, layer, e)
                for e in range(spec.num_experts or 0)
                for sub, sub_shape, sub_split in experts
            )
            continue
        buffer, parts = suffix == ROUTER_EXPERT_BIAS, parts_of(spec, suffix)
        out.append(Param(prefix + suffix, shape, split, stage, layer, buffer=buffer, parts=parts))
    return out


def layer_kind(spec: ModelSpec, layer: int) -> tuple[bool, bool]:
    """``(moe, linear)``: decoder layer ``layer``'s MLP and attention kinds."""
    return spec.is_moe_layer(layer), is_linear_layer(spec, layer)


def layer_kinds(spec: ModelSpec) -> set[tuple[bool, bool]]:
    """Every ``layer_kind`` of the model's layers, and the MTP layers' (never linear)."""
    kinds = {layer_kind(spec, layer) for layer in range(spec.num_layers)}
    return kinds | {(spec.mtp_is_moe, False)} if spec.mtp_num_layers else kinds


def _norm(prefix: str, spec: ModelSpec) -> list[tuple[str, Shape, Split]]:
    out: list[tuple[str, Shape, Split]] = [
        (f"{prefix}.weight", (spec.hidden_size,), Split.REPLICATED)
    ]
    if spec.normalization is NormKind.LAYERNORM:
        out.append((f"{prefix}.bias", (spec.hidden_size,), Split.REPLICATED))
    return out


def mtp_head_suffixes(spec: ModelSpec) -> list[tuple[str, Shape, Split]]:
    """An MTP layer's parameters before its transformer layer, in registration order: the
    embedding's norm, the hidden state's, and the column-parallel projection of both."""
    h = spec.hidden_size
    return [
        *_norm("enorm", spec),
        *_norm("hnorm", spec),
        ("eh_proj.weight", (h, 2 * h), Split.COLUMN),
    ]


def mtp_tail_suffixes(spec: ModelSpec) -> list[tuple[str, Shape, Split]]:
    """An MTP layer's parameters after its transformer layer: the final norm."""
    return _norm("final_layernorm", spec)


def _mtp_layer(
    spec: ModelSpec,
    k: int,
    inner: list[tuple[str, Shape, Split]],
    experts: list[tuple[str, Shape, Split]],
) -> list[Param]:
    """MTP layer ``k``: its norms and projection, its transformer layer (of the last decoder
    layer's kind, experts expanded), its final norm."""
    head = f"{MTP_PREFIX}{k}."
    out = [Param(head + s, shape, split, Stage.MTP) for s, shape, split in mtp_head_suffixes(spec)]
    out.extend(_layer_params(spec, mtp_layer_prefix(k), inner, experts, Stage.MTP, None))
    out.extend(
        Param(head + s, shape, split, Stage.MTP) for s, shape, split in mtp_tail_suffixes(spec)
    )
    return out


def state_name(state: str, param: str) -> str:
    """Canonical name of optimizer state ``state`` of ``param``."""
    return f"{state}/{param}"


def local_layer_name(suffix: str, naming: Naming, mla: bool = False) -> str:
    if naming is not Naming.LOCAL:
        return suffix
    if mla and suffix in _MLA_TE_TO_LOCAL:
        return _MLA_TE_TO_LOCAL[suffix]
    if mla and suffix.startswith("input_layernorm."):
        return suffix
    return _TE_TO_LOCAL.get(suffix, suffix)


def te_layer_suffix(suffix: str, moe: bool = False, mla: bool = False) -> str:
    """The TE spelling of a layer-relative parameter name in either spec (an MoE layer keeps
    ``pre_mlp_layernorm``: its MLP has no fused norm; a multi-latent attention layer keeps
    ``input_layernorm``)."""
    if moe and suffix.startswith("pre_mlp_layernorm."):
        return suffix
    if mla and suffix.startswith("input_layernorm."):
        return suffix
    if mla and suffix in _MLA_LOCAL_TO_TE:
        return _MLA_LOCAL_TO_TE[suffix]
    return _LOCAL_TO_TE.get(suffix, suffix)


def uses_local_names(names: list[str], mla: bool = False) -> bool:
    """Whether stored names follow the local spec: its attention norm is a module of its own
    (an MoE layer's ``pre_mlp_layernorm`` is one in both specs, so it cannot tell); under
    multi-latent attention, its q / kv norms are (TE fuses them into the up projections)."""
    if mla:
        return any(".self_attention.kv_layernorm." in name for name in names)
    return any(name.split(".", 3)[-1].startswith("input_layernorm.") for name in names)
