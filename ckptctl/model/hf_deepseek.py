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

from ckptctl.errors import LayoutError
from ckptctl.model.geometry import Piece, Shape, whole
from ckptctl.model.hf_routed import (
    ROUTED_KEYS,
    FamilyRules,
    count,
    routed_config,
    routed_config_problems,
    routed_fields,
    routed_problems,
)
from ckptctl.model.layout import ModelSpec
from ckptctl.model.mla import MlaSpec, RopeType

Entry = tuple[str, str, Shape, tuple[Piece, ...]]

MODEL_TYPE = "deepseek_v3"
DENSE_FIRST = 3
"""transformers' default ``first_k_dense_replace`` for the family."""
LATENT_NORM_EPS = 1e-6
"""transformers' ``DeepseekV3RMSNorm`` default: the epsilon of ``q_a_layernorm`` and
``kv_a_layernorm``, which it builds without ``rms_norm_eps``."""
CONFIG_KEYS = ROUTED_KEYS | frozenset(
    """kv_lora_rank q_lora_rank qk_rope_head_dim v_head_dim qk_nope_head_dim qk_head_dim
    rope_interleave attention_bias""".split()  # noqa: SIM905
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
    return problems + routed_problems(spec, cls)


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
    }
    out.update(routed_config(spec))
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
    problems += routed_config_problems(config, DENSE_FIRST)
    if problems:
        raise LayoutError(problems)
    rope_type, rope = _rope(config)
    mla = MlaSpec(
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=count(config, "kv_lora_rank", 512),
        qk_head_dim=count(config, "qk_nope_head_dim", 128),
        qk_pos_emb_head_dim=count(config, "qk_rope_head_dim", 64),
        v_head_dim=count(config, "v_head_dim", 128),
        rope_type=rope_type,
        **rope,
    )
    out: dict[str, Any] = {"mla": mla, "num_query_groups": heads, "qk_layernorm": True}
    out["kv_channels"] = mla.q_head_dim
    return out | routed_fields(config, DENSE_FIRST)


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


RULES = FamilyRules(
    holds=(
        "multi-latent attention (YaRN or RoPE), SwiGLU MLPs in the first layers and SwiGLU "
        "routed experts with shared experts and a sigmoid router (score-correction bias, "
        "group-limited top-k) after, RMSNorm, tied or untied embeddings, no biases, "
        "multi-token prediction layers (model.layers.<num_hidden_layers + k>)"
    ),
    problems=family_problems,
    config=config,
    spec_fields=spec_fields,
)
