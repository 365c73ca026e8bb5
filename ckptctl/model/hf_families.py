"""The HF decoder families ckptctl writes and reads, and their ``config.json``, read strictly. Pure.

Each family is one transformers class whose tensors are a fixed function of the model spec:

* ``llama`` (``LlamaForCausalLM``): biases on every linear layer or none (``attention_bias`` with
  ``mlp_bias``, Megatron's ``add_bias_linear``);
* ``mistral`` (``MistralForCausalLM``): Llama without biases, full attention only;
* ``qwen2`` (``Qwen2ForCausalLM``): biases on q/k/v only (Megatron's ``add_qkv_bias``);
* ``qwen3`` (``Qwen3ForCausalLM``): an RMSNorm over each query and key head (``qk_layernorm``);
* mixture of experts, every layer routed: ``mixtral`` (``MixtralForCausalLM``, Mistral with
  experts, top-k weights renormalised), ``qwen2_moe`` (``Qwen2MoeForCausalLM``, Qwen2 with
  experts and a sigmoid-gated shared expert), ``qwen3_moe`` (``Qwen3MoeForCausalLM``, Qwen3 with
  experts); the Qwen ones renormalise top-k weights only with ``norm_topk_prob``;
* ``deepseek_v3`` (``DeepseekV3ForCausalLM``): multi-latent attention, dense layers first and
  routed ones with shared experts and a sigmoid router after (``hf_deepseek``);
* ``glm4_moe`` (``Glm4MoeForCausalLM``): DeepSeek-V3's routed layers under grouped-query
  attention with q/k/v biases, optional q/k norms and partial RoPE (``hf_glm``);
* ``gpt_oss`` (``GptOssForCausalLM``): sinks, biases and packed clamped-GEGLU experts
  (``hf_gpt_oss``);
* ``gemma3_text`` (``Gemma3ForCausalLM``): four norms per layer, GEGLU, local and global
  layers with RoPE bases of their own (``hf_gemma``).

All are gated SiLU MLPs, RMSNorm, RoPE (over every head dimension but in GLM-4.5). A model
none of them can hold is refused for HF with the reason. ``hf_config`` reads a family's
``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model import (
    hf_deepseek,
    hf_gemma,
    hf_glm,
    hf_gpt_oss,
    hf_qwen3_next,
    hf_qwen35,
    hf_windows,
    rope_scaling,
)
from ckptctl.model.hf_routed import FamilyRules
from ckptctl.model.layout import Activation, ModelSpec, NormKind, PositionEmbedding, RouterScore


@dataclass(frozen=True, slots=True)
class MoeNaming:
    """How an MoE family names its router and experts (hub checkpoint spelling)."""

    block: str
    """Module holding router (``<block>.gate``) and experts (``<block>.experts.<e>``)."""
    parts: tuple[str, str, str]
    """An expert's gate, up and down projections."""
    experts_key: str
    """``config.json`` key of the number of experts."""
    ffn_key: str
    """``config.json`` key of one expert's FFN size."""
    shared_gated_expert: bool = False
    """Every layer has one shared expert with a sigmoid gate (Qwen2-MoE)."""
    shared_experts: str | None = None
    """Module of ungated shared experts in every layer (DeepSeek-V3: ``shared_experts``)."""
    router_bias: str | None = None
    """The router's expert-bias buffer under the block (DeepSeek-V3's score correction)."""
    always_renormalise: bool = False
    """Top-k weights always renormalised (Mixtral); else ``norm_topk_prob`` says."""


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    """transformers' ``model_type``."""
    architecture: str
    qkv_bias: str
    """``all`` (q/k/v bias iff every linear has one), ``always`` or ``never``."""
    qk_norm: bool
    config_keys: frozenset[str]
    """Family-specific keys this module maps or checks (beyond the common ones)."""
    moe: MoeNaming | None = None
    """Set for mixture-of-experts families: every decoder layer's MLP is routed experts."""
    rules: FamilyRules | None = None
    """The family's own rules (DeepSeek-V3, GLM-4.5): its checks, ``config.json`` keys and
    RoPE settings; the common ones below do not apply."""


_QWEN_MOE_KEYS = frozenset(
    """num_experts num_local_experts num_experts_per_tok moe_intermediate_size norm_topk_prob
    decoder_sparse_step mlp_only_layers router_aux_loss_coef output_router_logits sliding_window
    use_sliding_window max_window_layers layer_types""".split()  # noqa: SIM905
)


_QWEN_SHARED_GATED = MoeNaming(
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    "num_experts",
    "moe_intermediate_size",
    shared_gated_expert=True,
)
"""Qwen2-MoE's, Qwen3-Next's and Qwen3.5-MoE's routed layers: experts and a gated shared
expert (``mlp.shared_expert``, ``mlp.shared_expert_gate``)."""


_ROUTED_NAMING = MoeNaming(
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    "n_routed_experts",
    "moe_intermediate_size",
    shared_experts="shared_experts",
    router_bias="gate.e_score_correction_bias",
)
"""DeepSeek-V3's and GLM-4.5's routed layers (``hf_routed``): one naming for both."""


FAMILIES = {
    f.name: f
    for f in (
        Family(
            "llama", "LlamaForCausalLM", "all", False, frozenset({"attention_bias", "mlp_bias"})
        ),
        Family("mistral", "MistralForCausalLM", "never", False, frozenset({"sliding_window"})),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            "always",
            False,
            frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}),
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            "never",
            True,
            frozenset(
                {
                    "attention_bias",
                    "sliding_window",
                    "use_sliding_window",
                    "max_window_layers",
                    "layer_types",
                }
            ),
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            "never",
            False,
            frozenset(
                """num_local_experts num_experts_per_tok router_aux_loss_coef
                output_router_logits router_jitter_noise sliding_window""".split()  # noqa: SIM905
            ),
            MoeNaming(
                "block_sparse_moe",
                ("w1", "w3", "w2"),
                "num_local_experts",
                "intermediate_size",
                always_renormalise=True,
            ),
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            "always",
            False,
            _QWEN_MOE_KEYS | {"shared_expert_intermediate_size", "qkv_bias"},
            _QWEN_SHARED_GATED,
        ),
        Family(
            hf_deepseek.MODEL_TYPE,
            "DeepseekV3ForCausalLM",
            "never",
            False,
            hf_deepseek.CONFIG_KEYS,
            _ROUTED_NAMING,
            rules=hf_deepseek.RULES,
        ),
        Family(
            hf_glm.MODEL_TYPE,
            "Glm4MoeForCausalLM",
            "always",
            False,
            hf_glm.CONFIG_KEYS,
            _ROUTED_NAMING,
            rules=hf_glm.RULES,
        ),
        Family(
            hf_gpt_oss.MODEL_TYPE,
            "GptOssForCausalLM",
            "all",
            False,
            hf_gpt_oss.CONFIG_KEYS,
            rules=hf_gpt_oss.RULES,
        ),
        Family(
            hf_gemma.MODEL_TYPE,
            "Gemma3ForCausalLM",
            "never",
            True,
            hf_gemma.CONFIG_KEYS,
            rules=hf_gemma.RULES,
        ),
        Family(
            hf_qwen35.MODEL_TYPE,
            "Qwen3_5ForCausalLM",
            "never",
            True,
            hf_qwen35.CONFIG_KEYS,
            rules=hf_qwen35.RULES,
        ),
        Family(
            hf_qwen3_next.MODEL_TYPE,
            "Qwen3NextForCausalLM",
            "never",
            True,
            hf_qwen3_next.CONFIG_KEYS,
            _QWEN_SHARED_GATED,
            rules=hf_qwen3_next.RULES,
        ),
        Family(
            hf_qwen3_next.QWEN35_MOE,
            "Qwen3_5MoeForCausalLM",
            "never",
            True,
            hf_qwen3_next.QWEN35_MOE_KEYS,
            replace(_QWEN_SHARED_GATED, always_renormalise=True),
            rules=hf_qwen3_next.QWEN35_MOE_RULES,
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "never",
            True,
            _QWEN_MOE_KEYS | {"attention_bias"},
            MoeNaming(
                "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size"
            ),
        ),
    )
}


HYBRIDS = (hf_qwen35.MODEL_TYPE, hf_qwen3_next.MODEL_TYPE, hf_qwen3_next.QWEN35_MOE)
"""The gated delta net families (Qwen3.5, Qwen3-Next, Qwen3.5-MoE)."""


def family_summary(family: Family) -> dict[str, str]:
    """What ``ckptctl formats`` says about a family."""
    bias = {
        "all": "biases on every linear layer or none",
        "always": "q/k/v biases",
        "never": "no biases",
    }[family.qkv_bias]
    norms = ", q/k RMSNorm" if family.qk_norm else ""
    mlp = "SwiGLU"
    if family.moe is not None:
        mlp = "SwiGLU routed experts"
        if family.moe.shared_gated_expert:
            mlp += " with a gated shared expert"
    if family.rules is not None:
        holds = family.rules.holds
    else:
        holds = f"{mlp}, RMSNorm, RoPE, GQA or MHA, tied or untied embeddings, {bias}{norms}"
        if family.name in hf_windows.EVERY_LAYER:
            holds += ", a sliding window on every layer or none"
        elif family.name in hf_windows.BY_LAYER_TYPE:
            holds += ", a sliding window on any layers (layer_types)"
    return {"model_type": family.name, "architecture": family.architecture, "holds": holds}


def choose_family(spec: ModelSpec) -> Family:
    """The family recorded in the spec, else the one the spec's features call for."""
    if spec.hf_family is not None:
        name = spec.hf_family
    elif spec.attention_sinks:
        name = hf_gpt_oss.MODEL_TYPE
    elif spec.post_sublayer_norms:
        name = hf_gemma.MODEL_TYPE
    elif spec.linear_attention is not None or spec.attention_output_gate:
        name = hf_qwen3_next.MODEL_TYPE if spec.is_moe else hf_qwen35.MODEL_TYPE
    elif spec.mla is not None:
        name = hf_deepseek.MODEL_TYPE
    elif spec.is_moe and spec.moe_router_score_function is RouterScore.SIGMOID:
        name = hf_glm.MODEL_TYPE
    elif spec.is_moe:
        if spec.qk_layernorm:
            name = "qwen3_moe"
        elif spec.moe_shared_expert_intermediate_size or spec.add_qkv_bias:
            name = "qwen2_moe"
        else:
            name = "mixtral"
    elif spec.qk_layernorm:
        name = "qwen3"
    elif spec.add_qkv_bias and not spec.add_bias_linear:
        name = "qwen2"
    else:
        # Llama has no window; Mistral is Llama with one on every layer
        name = "llama" if spec.window_size is None else "mistral"
    if name not in FAMILIES:
        raise LayoutError(
            f"HF family {name!r}: ckptctl writes {', '.join(FAMILIES)} (ckptctl formats)"
        )
    family = FAMILIES[name]
    check_family(spec, family)
    return family


def check_family(spec: ModelSpec, family: Family) -> None:
    """Raise ``LayoutError`` listing everything in ``spec`` that ``family`` cannot hold."""
    cls = family.architecture
    problems = []
    own = family.rules is not None and family.rules.own_activation
    if not own and (not spec.gated_linear_unit or spec.activation is not Activation.SILU):
        problems.append(
            f"{cls} needs a gated SiLU MLP (SwiGLU); this model has a {spec.mlp_name} "
            "(no transformers class ckptctl writes holds it; keep it as Megatron)"
        )
    if spec.normalization is not NormKind.RMSNORM:
        problems.append(f"{cls} needs RMSNorm, this model uses {spec.normalization}")
    if spec.position_embedding is not PositionEmbedding.ROPE:
        problems.append(f"{cls} needs RoPE, this model uses {spec.position_embedding}")
    if not own and (spec.attention_sinks or spec.activation_clamp or spec.glu_linear_offset):
        problems.append(f"{cls} has no attention sinks or clamped GLU (GptOssForCausalLM has)")
    if spec.softmax_off_by_one:
        problems.append(f"{cls} has no off-by-one softmax (softmax_type='off-by-one')")
    qwen35 = family.name in HYBRIDS
    if not qwen35 and (spec.linear_attention is not None or spec.attention_output_gate):
        problems.append(
            f"{cls} has no gated delta net layers or gated attention (Qwen3_5ForCausalLM, "
            "Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM have)"
        )
    problems.extend(hf_windows.problems(spec, family.name, cls))
    if family.name != hf_gemma.MODEL_TYPE:
        problems.extend(_gemma_feature_problems(spec, cls, qwen35))
    if spec.rope_scaling is not None:
        if family.rules is not None and not own:
            problems.append(f"{cls} has no {spec.rope_scaling.kind} RoPE scaling")
        problems.extend(rope_scaling.hf_problems(spec.rope_scaling, cls))
    if family.rules is not None:
        problems.extend(family.rules.problems(spec, cls))
        if problems:
            raise LayoutError(problems)
        return
    if spec.rotary_percent != 1.0:
        problems.append(
            f"rotary_percent={spec.rotary_percent}: {cls} rotates every head dimension and "
            "cannot express partial rotary embeddings; keep it as Megatron (reshard, "
            "consolidate --format megatron)"
        )
    if spec.mla is not None:
        problems.append(f"{cls} has no multi-latent attention")
    if spec.mtp_num_layers:
        problems.append(
            f"{cls} has no multi-token prediction layers (mtp_num_layers={spec.mtp_num_layers}); "
            "DeepseekV3ForCausalLM and Glm4MoeForCausalLM have"
        )
    if spec.qk_layernorm != family.qk_norm:
        problems.append(
            f"{cls} {'needs' if family.qk_norm else 'has no'} q/k layernorm "
            f"(qk_layernorm={spec.qk_layernorm})"
        )
    if spec.add_bias_linear and family.qkv_bias != "all":
        problems.append(f"{cls} has no biases on its MLP and output projection (add_bias_linear)")
    qkv_bias = spec.add_qkv_bias or spec.add_bias_linear
    if family.qkv_bias == "always" and not qkv_bias:
        problems.append(f"{cls} always has q/k/v biases; this model has none")
    if family.qkv_bias == "never" and qkv_bias:
        problems.append(f"{cls} cannot hold q/k/v biases (add_qkv_bias)")
    if family.qkv_bias == "all" and spec.add_qkv_bias and not spec.add_bias_linear:
        problems.append(f"{cls} cannot hold q/k/v-only biases (that is Qwen2ForCausalLM)")
    problems.extend(_moe_problems(spec, family))
    if problems:
        raise LayoutError(problems)


def _gemma_feature_problems(spec: ModelSpec, cls: str, centred: bool = False) -> list[str]:
    """Gemma 3's features, which only ``Gemma3ForCausalLM`` holds (``centred``: the family
    has Gemma's norms scaling by 1 + weight too)."""
    features = {
        "layernorm_zero_centered_gamma": spec.layernorm_zero_centered_gamma and not centred,
        "post_sublayer_norms": spec.post_sublayer_norms,
        "scaled_embedding": spec.scaled_embedding,
        "softmax_scale": spec.softmax_scale is not None,
        "local_rotary_base": spec.local_rotary_base is not None,
        "activation gelu_tanh": spec.activation is Activation.GELU_TANH,
    }
    held = [name for name, present in features.items() if present]
    if not held:
        return []
    return [f"{cls} has no {', '.join(held)} (Gemma3ForCausalLM has)"]


def _moe_problems(spec: ModelSpec, family: Family) -> list[str]:
    cls, moe = family.architecture, family.moe
    if moe is None:
        return [f"{cls} has no experts (num_experts={spec.num_experts})"] if spec.is_moe else []
    if not spec.is_moe:
        return [f"{cls} is a mixture-of-experts class; this model is dense"]
    problems = []
    if spec.dense_layers:
        problems.append(f"{cls} has experts in every layer; layers {list(spec.dense_layers)} of "
                        "this model are dense")  # fmt: skip
    if spec.moe_router_score_function is not RouterScore.SOFTMAX:
        problems.append(f"{cls} routes by softmax, not {spec.moe_router_score_function}")
    if spec.moe_router_expert_bias:
        problems.append(f"{cls} has no router expert bias (moe_router_enable_expert_bias)")
    if spec.add_bias_linear:
        problems.append(f"{cls} has no biases on its router and experts (add_bias_linear)")
    if moe.always_renormalise and spec.moe_router_pre_softmax:
        problems.append(f"{cls} renormalises the top-k weights; moe_router_pre_softmax does not")
    shared = spec.moe_shared_expert_intermediate_size
    if moe.shared_gated_expert and not (shared and spec.moe_shared_expert_gate):
        problems.append(f"{cls} has a gated shared expert in every layer; this model has not")
    if not moe.shared_gated_expert and shared:
        problems.append(f"{cls} has no shared experts (moe_shared_expert_intermediate_size)")
    return problems


def hf_config(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """``config.json`` for ``spec`` in its family's class."""
    family = choose_family(spec)
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.name,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.kv_channels,
        "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.norm_epsilon,
        "rope_theta": spec.rotary_base,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    if family.name == "llama":
        config["attention_bias"] = config["mlp_bias"] = spec.add_bias_linear
    if family.name == "qwen3":
        config["attention_bias"] = False
    if family.name == "qwen3_moe":
        config["attention_bias"] = False
    config.update(hf_windows.config_fields(spec, family.name, family.config_keys))
    if spec.rope_scaling is not None:
        config["rope_parameters"] = rope_scaling.hf_parameters(spec.rope_scaling, spec.rotary_base)
    if family.rules is not None:
        config.update(family.rules.config(spec))
    elif family.moe is not None:
        config.update(_moe_config(spec, family.moe))
    if family.name == hf_gemma.MODEL_TYPE:  # says them its own way (hidden_activation, per kind)
        del config["hidden_act"], config["rope_theta"]
    if family.name in HYBRIDS:  # in rope_parameters, with the rotated share
        del config["rope_theta"]
    if config.get("intermediate_size", 0) is None:  # a family without a dense MLP's size
        del config["intermediate_size"]
    return config


def _moe_config(spec: ModelSpec, moe: MoeNaming) -> dict[str, Any]:
    out: dict[str, Any] = {
        moe.experts_key: spec.num_experts,
        "num_experts_per_tok": spec.moe_router_topk,
        moe.ffn_key: spec.expert_ffn_size,
        "output_router_logits": False,
    }
    if not moe.always_renormalise:
        out["norm_topk_prob"] = not spec.moe_router_pre_softmax
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = []
    if moe.shared_gated_expert:
        out["shared_expert_intermediate_size"] = spec.moe_shared_expert_intermediate_size
    return out
