"""The mixture-of-experts part of Megatron's ``args``, both ways, with megatron-core's defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model.layout import ModelSpec, RouterScore

Value = Callable[..., Any]
"""``value(name, default=None)``: one field of ``args``, ``default`` where unset."""


def moe_spec(value: Value, num_layers: int) -> dict[str, Any]:
    """The MoE fields of the spec when ``num_experts`` is set."""
    experts = value("num_experts")
    if not experts:
        return {}
    score = value("moe_router_score_function", "softmax")
    if score not in {s.value for s in RouterScore}:
        raise LayoutError(f"args.moe_router_score_function={score!r}: not supported yet")
    scaling = value("moe_router_topk_scaling_factor")
    return {
        "num_experts": experts,
        "moe_ffn_hidden_size": value("moe_ffn_hidden_size"),
        "moe_router_topk": int(value("moe_router_topk", 2)),
        "moe_router_pre_softmax": bool(value("moe_router_pre_softmax", False)),
        "moe_router_score_function": RouterScore(score),
        "moe_router_expert_bias": bool(value("moe_router_enable_expert_bias", False)),
        "moe_shared_expert_intermediate_size": value("moe_shared_expert_intermediate_size"),
        "moe_shared_expert_gate": bool(value("moe_shared_expert_gate", False)),
        "moe_router_num_groups": value("moe_router_num_groups"),
        "moe_router_group_topk": value("moe_router_group_topk"),
        "moe_router_topk_scaling_factor": None if scaling is None else float(scaling),
        "dense_layers": dense_layers(value("moe_layer_freq", 1), num_layers),
    }


def dense_layers(freq: Any, num_layers: int) -> tuple[int, ...]:
    """The dense layers of ``--moe-layer-freq`` as megatron-core reads it: N (or "N") makes
    every N-th layer an MoE layer, from layer 0; a list says it per layer (0: dense)."""
    if isinstance(freq, str) and freq.strip().isdigit():
        freq = int(freq)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return tuple(i for i in range(num_layers) if i % freq)
    if isinstance(freq, list | tuple) and len(freq) == num_layers and set(freq) <= {0, 1}:
        return tuple(i for i, moe in enumerate(freq) if not moe)
    raise LayoutError(
        f"args.moe_layer_freq={freq!r}: not a layer frequency or a 0/1 pattern of "
        f"{num_layers} layers"
    )


def moe_args(spec: ModelSpec) -> dict[str, Any]:
    """The ``args`` fields that say ``spec``'s experts."""
    if not spec.is_moe:
        return {"num_experts": None}
    return {
        "num_experts": spec.num_experts,
        "moe_ffn_hidden_size": spec.expert_ffn_size,
        "moe_router_topk": spec.moe_router_topk,
        "moe_router_pre_softmax": spec.moe_router_pre_softmax,
        "moe_router_score_function": spec.moe_router_score_function.value,
        "moe_router_enable_expert_bias": spec.moe_router_expert_bias,
        "moe_shared_expert_intermediate_size": spec.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": spec.moe_shared_expert_gate,
        "moe_router_num_groups": spec.moe_router_num_groups,
        "moe_router_group_topk": spec.moe_router_group_topk,
        "moe_router_topk_scaling_factor": spec.moe_router_topk_scaling_factor,
        "moe_layer_freq": (
            [int(spec.is_moe_layer(i)) for i in range(spec.num_layers)] if spec.dense_layers else 1
        ),
        "moe_grouped_gemm": False,
    }
