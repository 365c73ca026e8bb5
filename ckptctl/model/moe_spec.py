"""The mixture-of-experts part of a model description: its consistency rules and how it reads
in a summary. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptctl.model.layout import ModelSpec


def moe_problems(spec: ModelSpec) -> list[str]:
    """What makes the MoE fields of ``spec`` inconsistent (MoE-only fields of a dense model
    included)."""
    if spec.num_experts is None:
        moe_only = (
            "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size",
            "moe_router_expert_bias",
            "moe_shared_expert_gate",
            "moe_router_num_groups",
            "moe_router_group_topk",
            "moe_router_topk_scaling_factor",
            "dense_layers",
        )
        return [
            f"{name} is set but num_experts is not"
            for name in moe_only
            if getattr(spec, name) not in (None, False, ())
        ]
    problems = []
    if spec.num_experts < 1:
        problems.append(f"num_experts={spec.num_experts} must be positive")
    if not 1 <= spec.moe_router_topk <= max(spec.num_experts, 1):
        problems.append(
            f"moe_router_topk={spec.moe_router_topk} must lie in 1..num_experts={spec.num_experts}"
        )
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(spec, name)
        if value is not None and value <= 0:
            problems.append(f"{name}={value} must be positive")
    if spec.moe_shared_expert_gate and not spec.moe_shared_expert_intermediate_size:
        problems.append("moe_shared_expert_gate needs moe_shared_expert_intermediate_size")
    dense = spec.dense_layers
    if list(dense) != sorted(set(dense)) or any(not 0 <= i < spec.num_layers for i in dense):
        problems.append(
            f"dense_layers={list(dense)} must be distinct layer indices below num_layers="
            f"{spec.num_layers}, in order"
        )
    elif len(dense) == spec.num_layers:
        problems.append("dense_layers holds every layer: the model has no MoE layer")
    groups, best = spec.moe_router_num_groups, spec.moe_router_group_topk
    if (groups is None) != (best is None):
        problems.append("moe_router_num_groups and moe_router_group_topk go together")
    elif groups is not None and best is not None:
        if groups < 1 or spec.num_experts % groups:
            problems.append(
                f"moe_router_num_groups={groups} does not divide num_experts={spec.num_experts}"
            )
        elif not 1 <= best <= groups:
            problems.append(f"moe_router_group_topk={best} must lie in 1..{groups}")
    return problems


def moe_description(spec: ModelSpec) -> str:
    """The routing of ``spec``'s MoE layers as ``inspect`` shows it."""
    routing = ""
    if spec.dense_layers:
        routing = f"dense MLP in layers {_ranges(spec.dense_layers)}, elsewhere "
    routing += f"top-{spec.moe_router_topk} of {spec.num_experts} experts (ffn "
    routing += f"{spec.expert_ffn_size}, {spec.moe_router_score_function}"
    routing += " before top-k)" if spec.moe_router_pre_softmax else ")"
    if spec.moe_router_expert_bias:
        routing += " with expert bias"
    if spec.moe_router_num_groups:
        routing += f", within the best {spec.moe_router_group_topk} of "
        routing += f"{spec.moe_router_num_groups} groups"
    if spec.moe_router_topk_scaling_factor is not None:
        routing += f", weights x{spec.moe_router_topk_scaling_factor:g}"
    if spec.moe_shared_expert_intermediate_size:
        gate = " gated" if spec.moe_shared_expert_gate else ""
        routing += f", shared{gate} expert ffn {spec.moe_shared_expert_intermediate_size}"
    return routing


def _ranges(layers: tuple[int, ...]) -> str:
    """``0-2, 7`` for (0, 1, 2, 7)."""
    out: list[str] = []
    start = prev = layers[0]
    for layer in (*layers[1:], None):
        if layer is not None and layer == prev + 1:
            prev = layer
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if layer is not None:
            start = prev = layer
    return ", ".join(out)
