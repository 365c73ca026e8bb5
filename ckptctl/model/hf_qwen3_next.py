"""The routed Qwen hybrids' HF families: Qwen3-Next (``Qwen3NextForCausalLM``, ``model_type:
qwen3_next``) and Qwen3.5-MoE's text decoder (``Qwen3_5MoeForCausalLM``, ``qwen3_5_moe_text``):
Qwen3.5's hybrid of gated delta net and gated-attention layers (``hf_qwen35``) with routed
experts in every layer (softmax router, top-k renormalised: as ``norm_topk_prob`` says in
Qwen3-Next, always in Qwen3.5-MoE) and a shared expert behind a sigmoid gate, as Qwen2-MoE
names them. Qwen3-Next's gated delta net keeps the fused projection grouped by key head
(``in_proj_qkvz``, ``in_proj_ba``); Qwen3.5-MoE's splits it as Qwen3.5 does. Qwen3.5-MoE's
config has no ``intermediate_size`` (no dense MLP): it is read as the experts' size. Pure.

Refused by name besides Qwen3.5's refusals: dense layers among the MoE ones
(``decoder_sparse_step``, ``mlp_only_layers``: the common checks), a router of another kind,
experts without the gated shared expert. The hub's multi-token prediction layer (``mtp.*``,
which transformers does not load) is Megatron's MTP layer (``hf_qwen35.mtp_tensors``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model import hf_qwen35
from ckptctl.model.hf_routed import FamilyRules
from ckptctl.model.layout import ModelSpec, RouterScore

MODEL_TYPE = "qwen3_next"
QWEN35_MOE = "qwen3_5_moe_text"
CONFIG_KEYS = hf_qwen35.CONFIG_KEYS | frozenset(
    """num_experts num_experts_per_tok moe_intermediate_size shared_expert_intermediate_size
    norm_topk_prob decoder_sparse_step mlp_only_layers router_aux_loss_coef
    output_router_logits""".split()  # noqa: SIM905
)
QWEN35_MOE_KEYS = hf_qwen35.CONFIG_KEYS | frozenset(
    """num_experts num_experts_per_tok moe_intermediate_size shared_expert_intermediate_size
    router_aux_loss_coef output_router_logits""".split()  # noqa: SIM905
)


def family_problems(spec: ModelSpec, cls: str) -> list[str]:
    """What in ``spec`` ``Qwen3NextForCausalLM`` cannot hold."""
    problems = hf_qwen35.family_problems(spec, cls, routed=True)
    if not spec.is_moe:
        problems.append(f"{cls} has routed experts in every layer; this model is dense")
        return problems
    if spec.dense_layers:
        problems.append(f"{cls} has experts in every layer; layers {list(spec.dense_layers)} "
                        "of this model are dense")  # fmt: skip
    if not (spec.moe_shared_expert_intermediate_size and spec.moe_shared_expert_gate):
        problems.append(f"{cls} has a shared expert behind a sigmoid gate in every MoE layer")
    if spec.moe_router_score_function is not RouterScore.SOFTMAX or spec.moe_router_expert_bias:
        problems.append(f"{cls} routes by softmax, with no expert bias")
    if spec.moe_router_num_groups or spec.moe_router_topk_scaling_factor is not None:
        problems.append(f"{cls} has no group-limited routing or top-k scaling")
    return problems


def config(spec: ModelSpec) -> dict[str, Any]:
    """The family's keys of ``config.json`` for ``spec``."""
    return _routed_config(spec) | {
        "norm_topk_prob": not spec.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _routed_config(spec: ModelSpec) -> dict[str, Any]:
    return hf_qwen35.config(spec) | {
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.moe_router_topk,
        "moe_intermediate_size": spec.expert_ffn_size,
        "shared_expert_intermediate_size": spec.moe_shared_expert_intermediate_size,
        "output_router_logits": False,
    }


def qwen35_moe_problems(spec: ModelSpec, cls: str) -> list[str]:
    """What in ``spec`` ``Qwen3_5MoeForCausalLM`` cannot hold."""
    problems = family_problems(spec, cls)
    if spec.moe_router_pre_softmax:
        problems.append(f"{cls} always renormalises its top-k weights (no norm_topk_prob)")
    return problems


def qwen35_moe_config(spec: ModelSpec) -> dict[str, Any]:
    """Qwen3.5-MoE's keys: no dense MLP size where it is the experts' (``intermediate_size``
    is written only when the model says another)."""
    out = _routed_config(spec)
    if spec.ffn_hidden_size == spec.expert_ffn_size:
        out["intermediate_size"] = None  # dropped: see hf_families.config
    return out


def qwen35_moe_spec_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return spec_fields({**config, "norm_topk_prob": True})


def spec_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelSpec`` fields of a Qwen3-Next ``config.json`` beyond the common ones."""
    problems = []
    sizes = {}
    for key in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key}={value!r} is not a positive integer")
        sizes[key] = value
    topk = config.get("num_experts_per_tok", 10)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        problems.append(f"num_experts_per_tok={topk!r} is not a positive integer")
    renormalise = config.get("norm_topk_prob", True)
    if not isinstance(renormalise, bool):
        problems.append(f"norm_topk_prob={renormalise!r} is not true or false")
    if problems:
        raise LayoutError(problems)
    return hf_qwen35.spec_fields(config) | {
        "num_experts": sizes["num_experts"],
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": sizes["moe_intermediate_size"],
        "moe_shared_expert_intermediate_size": sizes["shared_expert_intermediate_size"],
        "moe_shared_expert_gate": True,
        "moe_router_pre_softmax": not renormalise,
    }


QWEN35_MOE_RULES = FamilyRules(
    holds=(
        "Qwen3.5's gated delta net and gated-attention layers with routed SwiGLU experts in "
        "every layer (top-k always renormalised) and a sigmoid-gated shared expert"
    ),
    problems=qwen35_moe_problems,
    config=qwen35_moe_config,
    spec_fields=qwen35_moe_spec_fields,
)

RULES = FamilyRules(
    holds=(
        "Qwen3.5's gated delta net and gated-attention layers (in_proj_qkvz / in_proj_ba "
        "grouped by key head) with routed SwiGLU experts in every layer and a sigmoid-gated "
        "shared expert; the hub's MTP layer (mtp.*) as Megatron's"
    ),
    problems=family_problems,
    config=config,
    spec_fields=spec_fields,
)
