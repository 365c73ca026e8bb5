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
  experts); the Qwen ones renormalise top-k weights only with ``norm_topk_prob``.

All are gated SiLU MLPs, RMSNorm, full RoPE. A model none of them can hold is refused for HF
with the reason. Reading a ``config.json``, every key is mapped, checked against the value that
keeps the model plain, or on the harmless list; any other key is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.model.fields import refuse_fields
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


_QWEN_MOE_KEYS = frozenset(
    """num_experts num_local_experts num_experts_per_tok moe_intermediate_size norm_topk_prob
    decoder_sparse_step mlp_only_layers router_aux_loss_coef output_router_logits sliding_window
    use_sliding_window max_window_layers layer_types""".split()  # noqa: SIM905
)


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
            MoeNaming(
                "mlp",
                ("gate_proj", "up_proj", "down_proj"),
                "num_experts",
                "moe_intermediate_size",
                shared_gated_expert=True,
            ),
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

_MAPPED = frozenset(
    """architectures model_type hidden_size intermediate_size num_attention_heads
    num_key_value_heads head_dim num_hidden_layers vocab_size rms_norm_eps rope_theta
    rope_parameters rope_scaling max_position_embeddings tie_word_embeddings hidden_act
    ckptctl_hf_family""".split()  # noqa: SIM905
)
_HARMLESS = frozenset(
    """transformers_version torch_dtype dtype bos_token_id eos_token_id pad_token_id sep_token_id
    decoder_start_token_id initializer_range use_cache attention_dropout pretraining_tp
    _name_or_path _attn_implementation_autoset attn_implementation output_attentions
    output_hidden_states return_dict torchscript use_bfloat16 tf_legacy_loss is_decoder
    is_encoder_decoder add_cross_attention cross_attention_hidden_size tie_encoder_decoder
    pruned_heads chunk_size_feed_forward id2label label2id problem_type finetuning_task
    task_specific_params tokenizer_class prefix max_length min_length do_sample early_stopping
    num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p
    repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size
    bad_words_ids num_return_sequences output_scores return_dict_in_generate forced_bos_token_id
    forced_eos_token_id remove_invalid_values exponential_decay_length_penalty
    suppress_tokens begin_suppress_tokens""".split()  # noqa: SIM905
)
"""Generation defaults, token ids, initialisation and bookkeeping: nothing a weight means."""


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
    return {
        "model_type": family.name,
        "architecture": family.architecture,
        "holds": f"{mlp}, RMSNorm, RoPE, GQA or MHA, tied or untied embeddings, {bias}{norms}",
    }


def choose_family(spec: ModelSpec) -> Family:
    """The family recorded in the spec, else the one the spec's features call for."""
    if spec.hf_family is not None:
        name = spec.hf_family
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
        name = "llama"
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
    if not spec.gated_linear_unit or spec.activation is not Activation.SILU:
        problems.append(
            f"{cls} needs a gated SiLU MLP (SwiGLU); this model has a {spec.mlp_name} "
            "(no transformers class ckptctl writes holds it; keep it as Megatron)"
        )
    if spec.normalization is not NormKind.RMSNORM:
        problems.append(f"{cls} needs RMSNorm, this model uses {spec.normalization}")
    if spec.position_embedding is not PositionEmbedding.ROPE:
        problems.append(f"{cls} needs RoPE, this model uses {spec.position_embedding}")
    if spec.rotary_percent != 1.0:
        problems.append(
            f"rotary_percent={spec.rotary_percent}: {cls} rotates every head dimension and "
            "cannot express partial rotary embeddings; keep it as Megatron (reshard, "
            "consolidate --format megatron)"
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


def _moe_problems(spec: ModelSpec, family: Family) -> list[str]:
    cls, moe = family.architecture, family.moe
    if moe is None:
        return [f"{cls} has no experts (num_experts={spec.num_experts})"] if spec.is_moe else []
    if not spec.is_moe:
        return [f"{cls} is a mixture-of-experts class; this model is dense"]
    problems = []
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
    if "sliding_window" in family.config_keys:
        config["sliding_window"] = None
    if "use_sliding_window" in family.config_keys:
        config["use_sliding_window"] = False
    if family.moe is not None:
        config.update(_moe_config(spec, family.moe))
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


_REQUIRED = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"
)  # fmt: skip


def spec_from_config(
    config: Mapping[str, Any],
    make_vocab_size_divisible_by: int = 128,
    trusted: frozenset[str] = frozenset(),
) -> ModelSpec:
    """A ``ModelSpec`` from a ``config.json`` of one of the families, read strictly."""
    model_type = config.get("model_type") or "llama"
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise LayoutError(
            f"model_type={model_type!r}: ckptctl reads {', '.join(FAMILIES)} (ckptctl formats)"
        )
    family = FAMILIES[model_type]
    _check_keys(config, family, trusted)
    missing = [key for key in _REQUIRED if key not in config]
    if missing:
        raise CheckpointError(
            f"config.json lacks {', '.join(missing)}: not a model description ckptctl can read",
            hint="give the model's own config.json (--hf-config)",
        )
    for key in (*_REQUIRED, "num_key_value_heads", "head_dim"):
        _positive_count(config, key)
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    bias = bool(config.get("attention_bias", False))
    if family.name == "llama" and bias != bool(config.get("mlp_bias", False)):
        raise LayoutError("attention_bias and mlp_bias differ: Megatron has one add_bias_linear")
    if family.name in ("qwen3", "qwen3_moe") and bias:
        raise LayoutError("attention_bias=true: Megatron cannot hold biases on attention only")
    return ModelSpec(
        **_moe_spec(config, family),
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or hidden // heads,
        vocab_size=config["vocab_size"],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        gated_linear_unit=True,
        activation=Activation.SILU,
        add_bias_linear=bias and family.name == "llama",
        add_qkv_bias=family.qkv_bias == "always",
        qk_layernorm=family.qk_norm,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        rotary_base=_rope_theta(config),
        hf_family=None if family.name in ("llama", "mixtral") else family.name,
    )


def _positive_count(config: Mapping[str, Any], key: str) -> None:
    """A size or count of ``config.json`` must be a positive integer (``null`` where it may
    be left unset): anything else cannot describe a model."""
    value = config.get(key)
    if value is None and key not in _REQUIRED:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(
            f"config.json: {key}={value!r} is not a positive integer; not a model description"
        )


def _moe_spec(config: Mapping[str, Any], family: Family) -> dict[str, Any]:
    moe = family.moe
    if moe is None:
        return {}
    experts = config.get("num_experts", config.get("num_local_experts"))
    if not experts:
        raise LayoutError(f"config.json: {moe.experts_key} is missing for {family.architecture}")
    out: dict[str, Any] = {
        "num_experts": experts,
        "moe_router_topk": config.get("num_experts_per_tok", 2),
        "moe_router_pre_softmax": not (
            moe.always_renormalise or config.get("norm_topk_prob", False)
        ),
    }
    if moe.ffn_key != "intermediate_size":
        out["moe_ffn_hidden_size"] = config[moe.ffn_key]
    if moe.shared_gated_expert:
        out["moe_shared_expert_intermediate_size"] = config["shared_expert_intermediate_size"]
        out["moe_shared_expert_gate"] = True
    return out


def _rope_theta(config: Mapping[str, Any]) -> float:
    parameters = config.get("rope_parameters") or {}
    if not isinstance(parameters, Mapping):
        raise CheckpointError(f"config.json: rope_parameters={parameters!r} is not an object")
    value = config.get("rope_theta") or parameters.get("rope_theta") or 10000.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"config.json: rope_theta={value!r} is not a number")
    return float(value)


def _check_keys(config: Mapping[str, Any], family: Family, trusted: frozenset[str]) -> None:
    changed, unknown = [], []
    for key, value in config.items():
        if key in trusted or key in _HARMLESS:
            continue
        if key not in _MAPPED and key not in family.config_keys:
            unknown.append(key)
        elif (problem := _plain_problem(key, value, config)) is not None:
            changed.append(problem)
    refuse_fields(changed, unknown, f" for model_type {family.name!r}")


def _plain_problem(key: str, value: Any, config: Mapping[str, Any]) -> str | None:
    """The key=value that makes the model more than its family's plain form, if it does."""
    if key == "hidden_act" and value != "silu":
        return f"hidden_act={value!r}"
    if key in ("rope_scaling", "rope_parameters") and value:
        if not isinstance(value, Mapping):
            return f"{key}={value!r}"
        extra = {k: v for k, v in value.items() if k != "rope_theta"}
        if extra.get("rope_type", "default") != "default" or set(extra) - {"rope_type"}:
            return f"{key}={dict(value)!r}"
    if key == "sliding_window" and value is not None and config.get("use_sliding_window", True):
        return f"sliding_window={value!r}"
    if key == "use_sliding_window" and value:
        return f"use_sliding_window={value!r}"
    if key == "layer_types" and (
        not isinstance(value, list | None) or any(kind != "full_attention" for kind in value or ())
    ):
        return f"layer_types={value!r}"
    if key == "decoder_sparse_step" and value != 1:
        return f"decoder_sparse_step={value!r} (dense layers between MoE layers)"
    if key == "mlp_only_layers" and value:
        return f"mlp_only_layers={value!r} (dense layers between MoE layers)"
    if key == "qkv_bias" and value is False:
        return "qkv_bias=False"
    return None
