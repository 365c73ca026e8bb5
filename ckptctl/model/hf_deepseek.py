"""DeepSeek-V3's HF family (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi K2, Moonlight) as
far as ckptctl carries it: multi-latent attention, and dense SwiGLU MLPs in the first layers
and routed experts with a shared expert and a sigmoid router (score-correction bias,
group-limited top-k) in the others. Its ``config.json`` read strictly and written back. Pure.

Dense layers first and routed ones after (``first_k_dense_replace``) are the model
description's ``dense_layers``. Not carried yet, and refused by name: multi-token prediction layers
(``num_nextn_predict_layers``), and queries rotated in halves rather than in interleaved pairs
(``rope_interleave=false``: Megatron-Core's multi-latent attention rotates the layout the hub's
checkpoints hold, which transformers reads with ``rope_interleave=true``).

Tensor names (hub spelling) against Megatron-Core's: ``self_attn.q_a_proj`` is
``linear_q_down_proj``, ``q_a_layernorm`` the norm fused into ``linear_q_up_proj`` (TE),
``q_b_proj`` is ``linear_q_up_proj`` (``q_proj`` when queries are not compressed),
``kv_a_proj_with_mqa`` is ``linear_kv_down_proj``, ``kv_a_layernorm`` the norm of
``linear_kv_up_proj``, ``kv_b_proj`` is ``linear_kv_up_proj``, ``o_proj`` is ``linear_proj``;
every one whole, in the same row order (Megatron's heads are HF's heads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.model.geometry import Piece, Shape, whole
from ckptctl.model.layout import ModelSpec, RouterScore
from ckptctl.model.mla import MlaSpec, RopeType

Entry = tuple[str, str, Shape, tuple[Piece, ...]]

MODEL_TYPE = "deepseek_v3"
LATENT_NORM_EPS = 1e-6
"""transformers' ``DeepseekV3RMSNorm`` default: the epsilon of ``q_a_layernorm`` and
``kv_a_layernorm``, which it builds without ``rms_norm_eps``."""
CONFIG_KEYS = frozenset(
    """moe_intermediate_size n_shared_experts n_routed_experts routed_scaling_factor
    kv_lora_rank q_lora_rank qk_rope_head_dim v_head_dim qk_nope_head_dim qk_head_dim n_group
    topk_group num_experts_per_tok first_k_dense_replace norm_topk_prob rope_interleave
    attention_bias num_nextn_predict_layers output_router_logits aux_loss_alpha seq_aux
    topk_method scoring_func ep_size moe_layer_freq""".split()  # noqa: SIM905
)
"""Keys of its ``config.json`` beyond the common ones."""


def attention_tensors(spec: ModelSpec, src: str, dst: str) -> list[Entry]:
    """A layer's multi-latent attention: (HF name, canonical name, shape, pieces)."""
    mla = spec.mla
    assert mla is not None
    h, n = spec.hidden_size, spec.num_attention_heads
    a, attn = f"{src}self_attention.", f"{dst}self_attn."
    out: list[Entry] = []

    def add(hf: str, canonical: str, shape: Shape) -> None:
        out.append((attn + hf, a + canonical, shape, (whole(shape),)))

    if mla.q_lora_rank is None:
        add("q_proj.weight", "linear_q_proj.weight", (n * mla.q_head_dim, h))
    else:
        add("q_a_proj.weight", "linear_q_down_proj.weight", (mla.q_lora_rank, h))
        add("q_a_layernorm.weight", "linear_q_up_proj.layer_norm_weight", (mla.q_lora_rank,))
        add("q_b_proj.weight", "linear_q_up_proj.weight", (n * mla.q_head_dim, mla.q_lora_rank))
    kv_down = (mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h)
    add("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight", kv_down)
    add("kv_a_layernorm.weight", "linear_kv_up_proj.layer_norm_weight", (mla.kv_lora_rank,))
    kv_rows = n * (mla.qk_head_dim + mla.v_head_dim)
    add("kv_b_proj.weight", "linear_kv_up_proj.weight", (kv_rows, mla.kv_lora_rank))
    add("o_proj.weight", "linear_proj.weight", (h, n * mla.v_head_dim))
    return out


def family_problems(spec: ModelSpec, cls: str) -> list[str]:
    """What in ``spec`` ``DeepseekV3ForCausalLM`` cannot hold."""
    problems = []
    if spec.mla is None:
        problems.append(f"{cls} has multi-latent attention; this model has not")
    elif not spec.qk_layernorm:
        problems.append(f"{cls} norms the compressed queries and keys (qk_layernorm)")
    if spec.add_bias_linear or spec.add_qkv_bias:
        problems.append(f"{cls} has no biases (add_bias_linear / add_qkv_bias)")
    if spec.mla is not None and spec.norm_epsilon != LATENT_NORM_EPS:
        problems.append(
            f"{cls} norms the compressed queries and keys with eps {LATENT_NORM_EPS:g} whatever "
            f"rms_norm_eps says, Megatron with its one norm epsilon ({spec.norm_epsilon:g})"
        )
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


def config(spec: ModelSpec) -> dict[str, Any]:
    """The family's keys of ``config.json`` for ``spec``."""
    mla = spec.mla
    assert mla is not None
    out: dict[str, Any] = {
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank,
        "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
        "qk_nope_head_dim": mla.qk_head_dim,
        "v_head_dim": mla.v_head_dim,
        "head_dim": mla.qk_pos_emb_head_dim,
        "rope_interleave": True,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
        "norm_topk_prob": True,
        "output_router_logits": False,
    }
    if spec.is_moe:
        experts = spec.num_experts or 0
        out.update(
            first_k_dense_replace=len(spec.dense_layers),
            n_routed_experts=experts,
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
    if mla.rope_type is RopeType.YARN:
        out["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": spec.rotary_base,
            "factor": mla.scaling_factor,
            "original_max_position_embeddings": mla.original_max_position_embeddings,
            "beta_fast": mla.beta_fast,
            "beta_slow": mla.beta_slow,
            "mscale": mla.mscale,
            "mscale_all_dim": mla.mscale_all_dim,
        }
    return out


def spec_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelSpec`` fields of a DeepSeek-V3 ``config.json`` beyond the common ones; what the
    spec cannot carry is refused by name."""
    problems = []
    layers = config["num_hidden_layers"]
    dense_first = _int(config, "first_k_dense_replace", 3)
    mtp = _int(config, "num_nextn_predict_layers", 0)
    if mtp:
        problems.append(f"num_nextn_predict_layers={mtp}: multi-token prediction layers are not "
                        "supported yet")  # fmt: skip
    if config.get("rope_interleave", True) is not True:
        problems.append(
            f"rope_interleave={config.get('rope_interleave')!r}: Megatron-Core's multi-latent "
            "attention rotates interleaved pairs only"
        )
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads", heads) != heads:
        problems.append(
            f"num_key_value_heads={config.get('num_key_value_heads')}: multi-latent attention "
            f"has a key and value per head ({heads})"
        )
    eps = config.get("rms_norm_eps", LATENT_NORM_EPS)
    if eps != LATENT_NORM_EPS:
        problems.append(
            f"rms_norm_eps={eps!r}: the compressed queries and keys are normed with eps "
            f"{LATENT_NORM_EPS:g} whatever it says, and Megatron has one norm epsilon"
        )
    if config.get("attention_bias"):
        problems.append("attention_bias=true: Megatron's multi-latent attention has no biases")
    for key, plain in (
        ("topk_method", "noaux_tc"),
        ("scoring_func", "sigmoid"),
        ("moe_layer_freq", 1),
    ):
        if key in config and config[key] != plain:
            problems.append(f"{key}={config[key]!r}")
    moe = dense_first < layers
    if moe and config.get("norm_topk_prob", True) is not True:
        problems.append(
            "norm_topk_prob=false: Megatron renormalises the top-k weights of a sigmoid router"
        )
    if problems:
        raise LayoutError(problems)
    rope_type, rope = _rope(config)
    mla = MlaSpec(
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=_int(config, "kv_lora_rank", 512),
        qk_head_dim=_int(config, "qk_nope_head_dim", 128),
        qk_pos_emb_head_dim=_int(config, "qk_rope_head_dim", 64),
        v_head_dim=_int(config, "v_head_dim", 128),
        rope_type=rope_type,
        **rope,
    )
    out: dict[str, Any] = {"mla": mla, "num_query_groups": heads, "qk_layernorm": True}
    out["kv_channels"] = mla.q_head_dim
    if not moe:
        return out
    experts = _int(config, "n_routed_experts", 256)
    ffn = _int(config, "moe_intermediate_size", 2048)
    groups = _int(config, "n_group", 1)
    return out | {
        "dense_layers": tuple(range(dense_first)),
        "num_experts": experts,
        "moe_ffn_hidden_size": ffn,
        "moe_router_topk": _int(config, "num_experts_per_tok", 8),
        "moe_router_score_function": RouterScore.SIGMOID,
        "moe_router_expert_bias": True,
        "moe_shared_expert_intermediate_size": _int(config, "n_shared_experts", 1) * ffn,
        "moe_router_num_groups": None if groups == 1 else groups,
        "moe_router_group_topk": None if groups == 1 else _int(config, "topk_group", 1),
        "moe_router_topk_scaling_factor": _float(config, "routed_scaling_factor", 1.0),
    }


def _rope(config: Mapping[str, Any]) -> tuple[RopeType, dict[str, Any]]:
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return RopeType.ROPE, {}
    if kind != "yarn":
        raise LayoutError(f"rope_parameters.rope_type={kind!r}: not supported yet")
    return RopeType.YARN, {
        "scaling_factor": float(parameters.get("factor", 1.0)),
        "original_max_position_embeddings": int(
            parameters.get("original_max_position_embeddings", 4096)
        ),
        "beta_fast": float(parameters.get("beta_fast", 32.0)),
        "beta_slow": float(parameters.get("beta_slow", 1.0)),
        "mscale": float(parameters.get("mscale", 1.0)),
        "mscale_all_dim": float(parameters.get("mscale_all_dim", 0.0)),
    }


def _int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"config.json: {key}={value!r} is not a count")
    return value


def _float(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"config.json: {key}={value!r} is not a number")
    return float(value)
