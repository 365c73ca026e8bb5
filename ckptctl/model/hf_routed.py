"""The routed layers DeepSeek-V3 and GLM-4.5 share in HF (``DeepseekV3ForCausalLM``,
``Glm4MoeForCausalLM``): dense SwiGLU MLPs in the first ``first_k_dense_replace`` layers, then
routed experts with ``n_shared_experts`` shared ones and a sigmoid router with its
score-correction bias, group-limited top-k (``n_group``, ``topk_group``) and scaled weights
(``routed_scaling_factor``); their ``config.json`` keys both ways. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import CheckpointError
from ckptctl.model.layout import ModelSpec, RouterScore


@dataclass(frozen=True, slots=True)
class FamilyRules:
    """A family whose model description takes rules of its own (``hf_deepseek``, ``hf_glm``):
    what of a spec it cannot hold, its ``config.json`` keys both ways (its RoPE settings
    included), and what ``ckptctl formats`` says it holds."""

    holds: str
    problems: Callable[[ModelSpec, str], list[str]]
    config: Callable[[ModelSpec], dict[str, Any]]
    spec_fields: Callable[[Mapping[str, Any]], dict[str, Any]]
    own_activation: bool = False
    """The family's MLP is not SwiGLU: ``problems`` judges the activation (and RoPE scaling,
    sliding windows), not the common checks."""


ROUTED_KEYS = frozenset(
    """moe_intermediate_size n_shared_experts n_routed_experts routed_scaling_factor n_group
    topk_group num_experts_per_tok first_k_dense_replace norm_topk_prob
    num_nextn_predict_layers output_router_logits aux_loss_alpha seq_aux topk_method
    scoring_func ep_size moe_layer_freq""".split()  # noqa: SIM905
)
"""Their ``config.json`` keys of the routed layers (and of multi-token prediction)."""


def routed_problems(spec: ModelSpec, cls: str) -> list[str]:
    """What in ``spec``'s MLPs ``cls`` cannot hold."""
    problems: list[str] = []
    if not spec.is_moe:
        return problems
    if spec.moe_router_score_function is not RouterScore.SIGMOID:
        problems.append(f"{cls} routes by sigmoid, not {spec.moe_router_score_function}")
    if not spec.moe_router_expert_bias:
        problems.append(f"{cls} has a router score-correction bias (moe_router_enable_expert_bias)")
    if spec.dense_layers != tuple(range(len(spec.dense_layers))):
        problems.append(
            f"{cls}'s dense layers come first (first_k_dense_replace); this model's are "
            f"layers {list(spec.dense_layers)}"
        )
    if spec.moe_shared_expert_gate:
        problems.append(f"{cls} has no gate on its shared experts")
    shared = spec.moe_shared_expert_intermediate_size
    if not shared or shared % spec.expert_ffn_size:
        problems.append(
            f"{cls}'s shared experts are n_shared_experts x moe_intermediate_size wide; "
            f"moe_shared_expert_intermediate_size={shared} is no multiple of "
            f"{spec.expert_ffn_size}"
        )
    return problems


def routed_config(spec: ModelSpec) -> dict[str, Any]:
    """The routed layers' ``config.json`` keys for ``spec``, and its MTP layers'."""
    out: dict[str, Any] = {
        "num_nextn_predict_layers": spec.mtp_num_layers,
        # Megatron renormalises a sigmoid router's weights only when it picks several experts
        "norm_topk_prob": not spec.is_moe or spec.moe_router_topk > 1,
        "output_router_logits": False,
    }
    if spec.is_moe:
        out.update(
            first_k_dense_replace=len(spec.dense_layers),
            n_routed_experts=spec.num_experts or 0,
            num_experts_per_tok=spec.moe_router_topk,
            moe_intermediate_size=spec.expert_ffn_size,
            n_shared_experts=(spec.moe_shared_expert_intermediate_size or 0)
            // spec.expert_ffn_size,
            n_group=spec.moe_router_num_groups or 1,
            topk_group=spec.moe_router_group_topk or 1,
            routed_scaling_factor=spec.moe_router_topk_scaling_factor or 1.0,
        )
    else:  # every layer dense: the MoE keys are unread
        out.update(
            first_k_dense_replace=spec.num_layers,
            n_routed_experts=1,
            num_experts_per_tok=1,
            moe_intermediate_size=spec.ffn_hidden_size,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
        )
    return out


def routed_config_problems(config: Mapping[str, Any], dense_default: int) -> list[str]:
    """The routed layers' keys of ``config.json`` that ckptctl cannot carry, by name."""
    problems = []
    for key, plain in (
        ("topk_method", "noaux_tc"),
        ("scoring_func", "sigmoid"),
        ("moe_layer_freq", 1),
    ):
        if key in config and config[key] != plain:
            problems.append(f"{key}={config[key]!r}")
    routed = count(config, "first_k_dense_replace", dense_default) < config["num_hidden_layers"]
    # Megatron renormalises a sigmoid router's top-k weights when k > 1 and keeps the raw
    # score of a single expert; transformers renormalises exactly when norm_topk_prob says.
    several = count(config, "num_experts_per_tok", 8) > 1
    normalised = config.get("norm_topk_prob", True) is True
    if routed and normalised != several:
        problems.append(
            f"norm_topk_prob={str(normalised).lower()} with "
            f"{config.get('num_experts_per_tok', 8)} expert(s) per token: Megatron renormalises "
            "a sigmoid router's weights exactly when it picks more than one"
        )
    return problems


def routed_fields(config: Mapping[str, Any], dense_default: int) -> dict[str, Any]:
    """``ModelSpec`` fields of the routed layers (none when every layer is dense);
    ``dense_default``: the family's ``first_k_dense_replace`` when the file has none."""
    dense_first = count(config, "first_k_dense_replace", dense_default)
    mtp = {"mtp_num_layers": count(config, "num_nextn_predict_layers", 0)}
    if dense_first >= config["num_hidden_layers"]:
        return mtp
    ffn = count(config, "moe_intermediate_size", 2048)
    groups = count(config, "n_group", 1)
    return mtp | {
        "dense_layers": tuple(range(dense_first)),
        "num_experts": count(config, "n_routed_experts", 256),
        "moe_ffn_hidden_size": ffn,
        "moe_router_topk": count(config, "num_experts_per_tok", 8),
        "moe_router_score_function": RouterScore.SIGMOID,
        "moe_router_expert_bias": True,
        "moe_shared_expert_intermediate_size": count(config, "n_shared_experts", 1) * ffn,
        "moe_router_num_groups": None if groups == 1 else groups,
        "moe_router_group_topk": None if groups == 1 else count(config, "topk_group", 1),
        "moe_router_topk_scaling_factor": number(config, "routed_scaling_factor", 1.0),
    }


def count(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"config.json: {key}={value!r} is not a count")
    return value


def number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"config.json: {key}={value!r} is not a number")
    return float(value)
