"""GPT-OSS's HF family (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b). Pure.

Grouped-query attention with biases on q/k/v/o and a learned sink logit per head
(``self_attn.sinks``: megatron-core's ``softmax_type="learnable"`` offset), a sliding window on
the layers ``layer_types`` names (every other one, from layer 0, by default), YaRN RoPE, and in
every layer routed experts with biases behind a router with a bias (softmax over the top k).
Each expert's MLP is GPT-OSS's clamped GLU: ``(clamp(up, +-limit) + 1) * g * sigmoid(1.702 g)``
with ``g = clamp(gate, max=limit)``: Megatron's ``--quick-geglu --glu-linear-offset 1
--activation-func-clamp-value limit``.

The experts are stored packed, as transformers holds them: ``experts.gate_up_proj``
``[E, hidden, 2F]`` (each expert's ``linear_fc1`` transposed, gate and up columns interleaved),
``gate_up_proj_bias`` ``[E, 2F]`` (interleaved likewise), ``down_proj`` ``[E, F, hidden]``
(``linear_fc2`` transposed) and ``down_proj_bias`` ``[E, hidden]``: ``hf_layout`` lists one
entry per expert, and ``block`` says where in the packed tensor it lies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model import hf_windows, rope_scaling
from ckptctl.model.catalog import expert_name, expert_of
from ckptctl.model.geometry import Shape, whole
from ckptctl.model.hf_routed import FamilyRules
from ckptctl.model.layout import Activation, ModelSpec, RouterScore

MODEL_TYPE = "gpt_oss"
ALPHA = 1.702
"""The gate's sigmoid gain: quick-GELU's, the only one megatron-core has."""
OFFSET = 1.0
"""Added to the linear half (``up + 1``)."""
CONFIG_KEYS = frozenset(
    """num_local_experts num_experts_per_tok experts_per_token swiglu_alpha swiglu_limit
    attention_bias sliding_window layer_types router_aux_loss_coef output_router_logits
    initial_context_length""".split()  # noqa: SIM905
)
Entry = tuple[str, str, Shape, tuple[Any, ...]]


def family_problems(spec: ModelSpec, cls: str) -> list[str]:
    """What in ``spec`` ``GptOssForCausalLM`` cannot hold."""
    problems = []
    if not spec.is_moe or spec.dense_layers:
        problems.append(f"{cls} has routed experts in every layer")
    if (
        not spec.gated_linear_unit
        or spec.activation is not Activation.QUICK_GELU
        or spec.glu_linear_offset != OFFSET
        or spec.activation_clamp is None
    ):
        problems.append(
            f"{cls}'s experts are a clamped quick-GEGLU with the linear half + 1; this model "
            f"has a {spec.mlp_name}"
        )
    if not spec.add_bias_linear:
        problems.append(f"{cls} has biases on every linear layer (add_bias_linear)")
    if not spec.attention_sinks:
        problems.append(f"{cls} has attention sinks (softmax_type learnable)")
    if spec.qk_layernorm or spec.mla is not None or spec.mtp_num_layers:
        problems.append(f"{cls} has no q/k norms, multi-latent attention or MTP layers")
    if spec.rotary_percent != 1.0:
        problems.append(f"{cls} rotates every head dimension (rotary_percent=1)")
    if spec.is_moe:
        if spec.moe_router_score_function is not RouterScore.SOFTMAX or spec.moe_router_pre_softmax:
            problems.append(f"{cls}'s router takes a softmax over the top k logits")
        if spec.moe_router_expert_bias or spec.moe_router_num_groups:
            problems.append(f"{cls}'s router has no expert bias buffer or groups")
        if spec.moe_shared_expert_intermediate_size or spec.moe_router_topk_scaling_factor:
            problems.append(f"{cls} has no shared experts or routing scale")
    return problems


def config(spec: ModelSpec) -> dict[str, Any]:
    """The family's keys of ``config.json`` for ``spec``."""
    parameters = (
        rope_scaling.hf_parameters(spec.rope_scaling, spec.rotary_base)
        if spec.rope_scaling is not None
        else {"rope_type": "default", "rope_theta": spec.rotary_base}
    )
    out: dict[str, Any] = {
        "intermediate_size": spec.expert_ffn_size,
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.moe_router_topk,
        "swiglu_limit": spec.activation_clamp,
        "attention_bias": True,
        "output_router_logits": False,
        "rope_parameters": parameters,
    }
    return out | hf_windows.config_fields(spec, MODEL_TYPE, CONFIG_KEYS)


def spec_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelSpec`` fields of a GPT-OSS ``config.json`` beyond the common ones."""
    problems = []
    alpha = config.get("swiglu_alpha", ALPHA)
    if alpha != ALPHA:
        problems.append(f"swiglu_alpha={alpha!r}: Megatron's quick-GEGLU has a gain of {ALPHA}")
    if config.get("attention_bias", True) is not True:
        problems.append("attention_bias=false: Megatron puts biases on attention and experts alike")
    topk = config.get("num_experts_per_tok", 4)
    if config.get("experts_per_token", topk) != topk:
        problems.append(
            f"experts_per_token={config.get('experts_per_token')!r} differs from "
            f"num_experts_per_tok={topk!r}"
        )
    limit = config.get("swiglu_limit", 7.0)
    if isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0:
        problems.append(f"swiglu_limit={limit!r} is not a positive number")
    if problems:
        raise LayoutError(problems)
    parameters = rope_scaling.hf_parameters_of(config)
    return {
        "num_experts": config.get("num_local_experts", 128),
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": config["intermediate_size"],
        "moe_router_pre_softmax": False,
        "add_bias_linear": True,
        "add_qkv_bias": False,
        "attention_sinks": True,
        "activation": Activation.QUICK_GELU,
        "glu_linear_offset": OFFSET,
        "activation_clamp": float(limit),
        "rope_scaling": rope_scaling.from_hf(
            parameters, config.get("max_position_embeddings", 131072)
        ),
        **hf_windows.spec_fields(config, MODEL_TYPE),
    }


RULES = FamilyRules(
    holds=(
        "grouped-query attention with biases and attention sinks, sliding windows per layer "
        "(layer_types), YaRN RoPE, routed experts with biases in every layer (clamped "
        "quick-GEGLU, packed as transformers holds them), softmax over the top-k router "
        "logits, untied or tied embeddings"
    ),
    problems=family_problems,
    config=config,
    spec_fields=spec_fields,
    own_activation=True,
)


# --------------------------------------------------------------------------- tensors


def attention_sinks(src: str, dst: str, heads: int) -> Entry:
    return (
        f"{dst}self_attn.sinks",
        f"{src}self_attention.core_attention.softmax_offset",
        (heads,),
        (whole((heads,)),),
    )


_PACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_SUFFIX = {
    "gate_up_proj": "linear_fc1.weight",
    "gate_up_proj_bias": "linear_fc1.bias",
    "down_proj": "linear_fc2.weight",
    "down_proj_bias": "linear_fc2.bias",
}


def moe_tensors(spec: ModelSpec, src: str, dst: str) -> list[Entry]:
    """Router, then each packed expert tensor as one entry per expert (its block)."""
    h, f, e = spec.hidden_size, spec.expert_ffn_size, spec.num_experts or 0
    out: list[Entry] = [
        (f"{dst}mlp.router.weight", f"{src}mlp.router.weight", (e, h), (whole((e, h)),)),
        (f"{dst}mlp.router.bias", f"{src}mlp.router.bias", (e,), (whole((e,)),)),
    ]
    shapes = {
        "gate_up_proj": (2 * f, h),
        "gate_up_proj_bias": (2 * f,),
        "down_proj": (h, f),
        "down_proj_bias": (h,),
    }
    for packed in _PACKED:
        shape = shapes[packed]
        for expert in range(e):
            canonical = expert_name(src, expert, _SUFFIX[packed])
            out.append((f"{dst}mlp.experts.{packed}", canonical, shape, (whole(shape),)))
    return out


@dataclass(frozen=True, slots=True)
class Block:
    """Where one expert's tensor lies in a packed one."""

    offset: int
    """Its first element in the packed tensor."""
    base_shape: Shape
    transposed: bool
    interleaved: bool


def block(spec: ModelSpec, hf_name: str, canonical: str, shape: Shape) -> Block | None:
    """The block of packed ``hf_name`` that expert tensor ``canonical`` (of ``shape``, in
    Megatron's orientation) is; ``None`` for a tensor stored whole."""
    packed = hf_name.rsplit(".", 1)[-1]
    expert = expert_of(canonical)
    if packed not in _SUFFIX or expert is None or ".mlp.experts." not in hf_name:
        return None
    size = prod(shape)
    transposed = len(shape) == 2
    stored = shape[::-1] if transposed else shape
    return Block(
        offset=expert * size,
        base_shape=(spec.num_experts or 0, *stored),
        transposed=transposed,
        interleaved=packed.startswith("gate_up"),
    )
