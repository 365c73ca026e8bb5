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


class Stage(StrEnum):
    """Where a parameter lives in the pipeline."""

    FIRST = "first"
    """First stage, first virtual chunk (embeddings)."""
    LAYER = "layer"
    """The stage and chunk owning the transformer layer."""
    LAST = "last"
    """Last stage, last virtual chunk (final norm, output layer)."""


class Naming(StrEnum):
    """Megatron-Core's two layer specs name the pre-attention/pre-MLP norms differently."""

    TE = "te"
    """TransformerEngine fused names: ``linear_qkv.layer_norm_weight``."""
    LOCAL = "local"
    """Local spec names: ``input_layernorm.weight``, ``pre_mlp_layernorm.weight``."""


OPTIMIZER_STATES = ("fp32_param", "exp_avg", "exp_avg_sq", "step")
"""Per-parameter optimizer state kept beside each weight (Adam with fp32 master weights)."""

_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_LOCAL_TO_TE = {local: te for te, local in _TE_TO_LOCAL.items()}

LAYER_PREFIX = "decoder.layers."


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    """Canonical name (global layer index, TE spec spelling)."""
    shape: Shape
    """Canonical shape: TP-merged, vocabulary unpadded."""
    split: Split
    stage: Stage
    layer: int | None = None

    @property
    def no_weight_decay(self) -> bool:
        """Megatron's default rule: biases and 1-D parameters get no weight decay."""
        return self.name.endswith(".bias") or len(self.shape) == 1


def layer_suffixes(spec: ModelSpec) -> list[tuple[str, Shape, Split]]:
    """Parameters of one transformer layer in Megatron-Core's registration order."""
    h, d = spec.hidden_size, spec.kv_channels
    bias = spec.add_bias_linear
    layernorm = spec.normalization is NormKind.LAYERNORM
    out: list[tuple[str, Shape, Split]] = [
        ("self_attention.linear_proj.weight", (h, spec.num_attention_heads * d), Split.ROW)
    ]
    if bias:
        out.append(("self_attention.linear_proj.bias", (h,), Split.REPLICATED))
    out.append(("self_attention.linear_qkv.layer_norm_weight", (h,), Split.REPLICATED))
    if layernorm:
        out.append(("self_attention.linear_qkv.layer_norm_bias", (h,), Split.REPLICATED))
    out.append(("self_attention.linear_qkv.weight", (spec.qkv_rows, h), Split.COLUMN))
    if bias or spec.add_qkv_bias:
        out.append(("self_attention.linear_qkv.bias", (spec.qkv_rows,), Split.COLUMN))
    if spec.qk_layernorm:
        # One norm over a head's kv_channels, shared by every head (TP-replicated).
        for which in ("q", "k"):
            out.append((f"self_attention.{which}_layernorm.weight", (d,), Split.REPLICATED))
            if layernorm:
                out.append((f"self_attention.{which}_layernorm.bias", (d,), Split.REPLICATED))
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
    return out


def local_spec_order(suffixes: list[str]) -> list[str]:
    """TE-spelled layer suffixes in the local spec's ``named_parameters`` order: there the
    pre-attention norm is the layer's own first module (``input_layernorm``), not part of
    ``linear_qkv``; everything else keeps its place."""
    first = [s for s in suffixes if s.startswith("self_attention.linear_qkv.layer_norm_")]
    return first + [s for s in suffixes if s not in first]


def parameters(spec: ModelSpec) -> list[Param]:
    """Every canonical parameter of ``spec``, in model order."""
    return list(_parameters(spec))


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
    suffixes = layer_suffixes(spec)
    for layer in range(spec.num_layers):
        params.extend(
            Param(f"{LAYER_PREFIX}{layer}.{suffix}", shape, split, Stage.LAYER, layer)
            for suffix, shape, split in suffixes
        )
    params.append(Param("decoder.final_layernorm.weight", (h,), Split.REPLICATED, Stage.LAST))
    if spec.normalization is NormKind.LAYERNORM:
        params.append(Param("decoder.final_layernorm.bias", (h,), Split.REPLICATED, Stage.LAST))
    if not spec.tie_embeddings:
        params.append(Param("output_layer.weight", (spec.vocab_size, h), Split.VOCAB, Stage.LAST))
    return tuple(params)


def state_name(state: str, param: str) -> str:
    """Canonical name of optimizer state ``state`` of ``param``."""
    return f"{state}/{param}"


def local_layer_name(suffix: str, naming: Naming) -> str:
    return _TE_TO_LOCAL.get(suffix, suffix) if naming is Naming.LOCAL else suffix


def te_layer_suffix(suffix: str) -> str:
    """The TE spelling of a layer-relative parameter name in either spec."""
    return _LOCAL_TO_TE.get(suffix, suffix)


def uses_local_names(names: list[str]) -> bool:
    return any(name.split(".", 3)[-1] in _LOCAL_TO_TE for name in names)
