"""GLM-4.5's HF family (``Glm4MoeForCausalLM``: GLM-4.5, 4.6, 4.7 and their Air sizes):
grouped-query attention with q/k/v biases (``attention_bias``; the output projection has none)
and, optionally, an RMSNorm over each query and key head (``use_qk_norm``), RoPE over a part of
each head (``partial_rotary_factor``: Megatron's ``rotary_percent``, the first dimensions
rotated in halves alike), and DeepSeek-V3's routed layers (``hf_routed``: dense layers first,
routed experts with shared ones and a sigmoid router after). Pure.
Its multi-token prediction layers (``num_nextn_predict_layers``, which GLM-4.5's own configs set
to 1) are DeepSeek-V3's (``hf_layout``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.model.hf_routed import (
    ROUTED_KEYS,
    FamilyRules,
    routed_config,
    routed_config_problems,
    routed_fields,
    routed_problems,
)
from ckptctl.model.layout import ModelSpec

MODEL_TYPE = "glm4_moe"
DENSE_FIRST = 1
"""transformers' default ``first_k_dense_replace`` for the family."""
PARTIAL_ROTARY = 0.5
"""transformers' default ``partial_rotary_factor`` for the family."""
CONFIG_KEYS = ROUTED_KEYS | frozenset({"attention_bias", "use_qk_norm", "partial_rotary_factor"})


def family_problems(spec: ModelSpec, cls: str) -> list[str]:
    """What in ``spec`` ``Glm4MoeForCausalLM`` cannot hold."""
    problems = []
    if spec.mla is not None:
        problems.append(f"{cls} has no multi-latent attention")
    if spec.add_bias_linear:
        problems.append(f"{cls} has biases on q/k/v only, not on every linear (add_bias_linear)")
    return problems + routed_problems(spec, cls)


def config(spec: ModelSpec) -> dict[str, Any]:
    """The family's keys of ``config.json`` for ``spec``."""
    return {
        "attention_bias": spec.add_qkv_bias,
        "use_qk_norm": spec.qk_layernorm,
        "head_dim": spec.kv_channels,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rotary_base,
            "partial_rotary_factor": spec.rotary_percent,
        },
        **routed_config(spec),
    }


def spec_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelSpec`` fields of a GLM-4.5 ``config.json`` beyond the common ones; what the spec
    cannot carry is refused by name."""
    problems = routed_config_problems(config, DENSE_FIRST)
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind != "default":
        problems.append(f"rope_parameters.rope_type={kind!r}: not supported yet")
    if problems:
        raise LayoutError(problems)
    partial = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    partial = PARTIAL_ROTARY if partial is None else partial
    if isinstance(partial, bool) or not isinstance(partial, int | float) or not 0 < partial <= 1:
        raise CheckpointError(f"config.json: partial_rotary_factor={partial!r} is no share")
    return {
        "add_qkv_bias": bool(config.get("attention_bias", False)),
        "qk_layernorm": bool(config.get("use_qk_norm", False)),
        "rotary_percent": float(partial),
        **routed_fields(config, DENSE_FIRST),
    }


RULES = FamilyRules(
    holds=(
        "SwiGLU MLPs in the first layers and SwiGLU routed experts with shared experts and a "
        "sigmoid router (score-correction bias, group-limited top-k) after, GQA with q/k/v "
        "biases or none, optional q/k RMSNorm, partial RoPE, RMSNorm, tied or untied "
        "embeddings, multi-token prediction layers (model.layers.<num_hidden_layers + k>)"
    ),
    problems=family_problems,
    config=config,
    spec_fields=spec_fields,
)
