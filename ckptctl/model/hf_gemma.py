"""Gemma 3's HF text family (``Gemma3ForCausalLM``: gemma-3-1b, and the text decoder of the larger
ones). Pure.

Grouped-query attention with an RMSNorm over each query and key head, softmax scaled by
``query_pre_attn_scalar ** -0.5``, a sliding window on the layers ``layer_types`` names (by
default five of every six: ``sliding_window_pattern``); the windowed layers rotate with their
own RoPE base (``rope_local_base_freq``, plain), the others with ``rope_theta`` and optionally
linear scaling; a GEGLU MLP with GELU's tanh approximation; four RMSNorms per layer (before and
after attention, before and after the MLP), each scaling by ``1 + weight``; the embedding's
output multiplied by ``sqrt(hidden_size)``; no biases. In Megatron the norms after attention and
MLP are Megatron-Bridge's ``linear_proj.post_layernorm`` and ``linear_fc2.post_layernorm``.

Refused by name: logit soft-capping (Gemma 2's, ``attn_logit_softcapping`` /
``final_logit_softcapping``: megatron-core has none), bidirectional attention, biases, and
RoPE settings of the windowed layers other than plain RoPE at their base.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model import hf_windows, rope_scaling
from ckptctl.model.hf_routed import FamilyRules
from ckptctl.model.layout import Activation, ModelSpec

MODEL_TYPE = "gemma3_text"
HIDDEN_ACTIVATION = "gelu_pytorch_tanh"
DEFAULT_PATTERN = 6
"""``sliding_window_pattern`` where a config leaves it out: every sixth layer attends fully."""
CONFIG_KEYS = frozenset(
    """hidden_activation query_pre_attn_scalar sliding_window sliding_window_pattern
    _sliding_window_pattern layer_types
    rope_local_base_freq final_logit_softcapping attn_logit_softcapping
    use_bidirectional_attention attention_bias cache_implementation""".split()  # noqa: SIM905
)
_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
"""transformers' RoPE bases where a config gives none."""


def family_problems(spec: ModelSpec, cls: str) -> list[str]:
    """What in ``spec`` ``Gemma3ForCausalLM`` cannot hold."""
    problems = []
    if not spec.gated_linear_unit or spec.activation is not Activation.GELU_TANH:
        problems.append(f"{cls}'s MLP is a GEGLU with GELU's tanh form; this has a {spec.mlp_name}")
    if not (spec.layernorm_zero_centered_gamma and spec.post_sublayer_norms):
        problems.append(
            f"{cls} has norms before and after attention and MLP, scaling by 1 + weight "
            "(layernorm_zero_centered_gamma, post_sublayer_norms)"
        )
    if not spec.scaled_embedding:
        problems.append(f"{cls} scales its embedding by sqrt(hidden_size)")
    if not spec.qk_layernorm:
        problems.append(f"{cls} has q/k norms")
    if spec.add_bias_linear or spec.add_qkv_bias:
        problems.append(f"{cls} has no biases")
    if spec.is_moe or spec.mla is not None or spec.mtp_num_layers or spec.attention_sinks:
        problems.append(f"{cls} has no experts, multi-latent attention, MTP layers or sinks")
    if spec.rotary_percent != 1.0:
        problems.append(f"{cls} rotates every head dimension (rotary_percent=1)")
    if spec.activation_clamp is not None or spec.glu_linear_offset:
        problems.append(f"{cls}'s GEGLU is not clamped or offset")
    scaling = spec.rope_scaling
    if scaling is not None and scaling.kind is not rope_scaling.RopeScalingKind.LINEAR:
        problems.append(f"{cls} scales RoPE linearly only, not by {scaling.kind}")
    if spec.window_size is not None and spec.local_rotary_base is None:
        problems.append(f"{cls}'s windowed layers have a RoPE base of their own")
    return problems


def config(spec: ModelSpec) -> dict[str, Any]:
    """The family's keys of ``config.json`` for ``spec``."""
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rotary_base}
    if spec.rope_scaling is not None:
        full = rope_scaling.hf_parameters(spec.rope_scaling, spec.rotary_base)
    out: dict[str, Any] = {
        "hidden_activation": HIDDEN_ACTIVATION,
        "query_pre_attn_scalar": query_pre_attn_scalar(spec),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "rope_parameters": {"full_attention": full},
    }
    if spec.local_rotary_base is not None:
        local = {"rope_type": "default", "rope_theta": spec.local_rotary_base}
        out["rope_parameters"]["sliding_attention"] = local
    out |= hf_windows.config_fields(spec, MODEL_TYPE, CONFIG_KEYS)
    if spec.window_size is None:
        out["layer_types"] = ["full_attention"] * spec.num_layers
    return out


def query_pre_attn_scalar(spec: ModelSpec) -> float | int:
    """``query_pre_attn_scalar`` whose ``** -0.5`` is the spec's softmax scale: the integer
    Gemma's configs hold where it gives the scale exactly."""
    scale = spec.softmax_scale if spec.softmax_scale is not None else spec.kv_channels**-0.5
    scalar = scale**-2
    whole = round(scalar)
    if whole > 0 and whole**-0.5 == scale:
        return whole
    if scalar**-0.5 != scale:
        raise LayoutError(
            f"softmax_scale={scale!r} is no query_pre_attn_scalar ** -0.5 that "
            f"{MODEL_TYPE} can hold exactly"
        )
    return scalar


def spec_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelSpec`` fields of a Gemma 3 ``config.json`` beyond the common ones."""
    problems = []
    activation = config.get("hidden_activation", HIDDEN_ACTIVATION)
    if activation != HIDDEN_ACTIVATION or config.get("hidden_act", activation) != activation:
        problems.append(f"hidden_activation={activation!r}: ckptctl reads {HIDDEN_ACTIVATION}")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            problems.append(f"{key}={config[key]!r}: megatron-core has no logit soft-capping")
    if config.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=true: ckptctl reads causal decoders")
    if config.get("attention_bias"):
        problems.append("attention_bias=true: Gemma 3 has no biases")
    scalar = config.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, int | float) or not scalar > 0:
        problems.append(f"query_pre_attn_scalar={scalar!r} is not a positive number")
    for key in ("sliding_window_pattern", "_sliding_window_pattern"):  # the latter: as saved
        pattern = config.get(key, DEFAULT_PATTERN)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            problems.append(f"{key}={pattern!r} is not a layer count")
    if problems:
        raise LayoutError(problems)
    full, local = _rope_parameters(config)
    windows = hf_windows.spec_fields(config, MODEL_TYPE)
    return {
        "activation": Activation.GELU_TANH,
        "layernorm_zero_centered_gamma": True,
        "post_sublayer_norms": True,
        "scaled_embedding": True,
        "qk_layernorm": True,
        "softmax_scale": float(scalar) ** -0.5,
        "rotary_base": _theta(full, "full_attention"),
        "rope_scaling": _linear(full),
        "local_rotary_base": _theta(local, "sliding_attention") if windows else None,
        **windows,
    }


def _rope_parameters(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full-attention and windowed layers' RoPE parameters, as transformers' Gemma 3
    config reads them: ``rope_parameters`` per layer kind, else ``rope_theta`` with an older
    config's ``rope_scaling`` and ``rope_local_base_freq``."""
    parameters = config.get("rope_parameters")
    if parameters is not None and (
        not isinstance(parameters, Mapping)
        or set(parameters) - set(_THETA)
        or not all(isinstance(v, Mapping) for v in parameters.values())
    ):
        raise LayoutError(
            f"rope_parameters={parameters!r}: Gemma 3 gives them per layer kind "
            f"({', '.join(_THETA)})"
        )
    full = dict((parameters or {}).get("full_attention") or {"rope_type": "default"})
    local = dict((parameters or {}).get("sliding_attention") or {"rope_type": "default"})
    scaling = config.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise LayoutError(f"rope_scaling={scaling!r} is not an object")
        full.update(scaling)
    full.setdefault("rope_theta", config.get("rope_theta", _THETA["full_attention"]))
    local.setdefault("rope_theta", config.get("rope_local_base_freq", _THETA["sliding_attention"]))
    if local.get("rope_type", local.get("type", "default")) != "default" or set(local) - {
        "rope_type",
        "type",
        "rope_theta",
    }:
        raise LayoutError(
            f"rope_parameters.sliding_attention={local!r}: ckptctl reads plain RoPE on "
            "Gemma 3's windowed layers"
        )
    return full, local


def _theta(parameters: Mapping[str, Any], kind: str) -> float:
    value = parameters.get("rope_theta")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 1:
        raise LayoutError(f"rope_parameters.{kind}.rope_theta={value!r} is not a RoPE base")
    return float(value)


def _linear(parameters: Mapping[str, Any]) -> rope_scaling.RopeScaling | None:
    """The full-attention layers' scaling: none or linear."""
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return rope_scaling.from_hf(parameters, 0)  # refuses keys plain RoPE does not have
    extra = sorted(set(parameters) - {"rope_type", "type", "rope_theta", "factor"})
    if kind != "linear" or extra:
        raise LayoutError(
            f"rope_parameters.full_attention={dict(parameters)!r}: ckptctl reads plain or "
            "linear RoPE on Gemma 3's full-attention layers"
        )
    factor = parameters.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
        raise LayoutError(f"rope_parameters.full_attention.factor={factor!r} is not a factor")
    return rope_scaling.RopeScaling(kind=rope_scaling.RopeScalingKind.LINEAR, factor=float(factor))


RULES = FamilyRules(
    holds=(
        "grouped-query attention with q/k norms and its own softmax scale, sliding windows "
        "per layer (layer_types) with their own RoPE base, linear RoPE scaling on the "
        "full-attention layers, GEGLU (tanh), four norms per layer scaling by 1 + weight, "
        "scaled embedding, tied or untied embeddings; no soft-capping"
    ),
    problems=family_problems,
    config=config,
    spec_fields=spec_fields,
    own_activation=True,
)
