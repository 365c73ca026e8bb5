"""Reading an HF ``config.json`` of one of the families (``hf_families``) into a ``ModelSpec``,
strictly: every key is mapped, checked against the value that keeps the model plain, or on the
harmless list; any other key is refused by name. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.model import hf_gemma, hf_qwen3_next, hf_windows, rope_scaling
from ckptctl.model.fields import refuse_fields
from ckptctl.model.hf_families import FAMILIES, Family
from ckptctl.model.layout import Activation, ModelSpec

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


_REQUIRED = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"
)  # fmt: skip


def has_family_table(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` is of a family ckptctl maps (its refusals then say most)."""
    return (config.get("model_type") or "llama") in FAMILIES


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
    if model_type == hf_qwen3_next.QWEN35_MOE and "intermediate_size" not in config:
        # experts in every layer and no dense MLP: Megatron's ffn size is the experts'
        config = {**config, "intermediate_size": config.get("moe_intermediate_size")}
    missing = [key for key in _REQUIRED if key not in config]
    if missing:
        raise CheckpointError(
            f"config.json lacks {', '.join(missing)}: not a model description ckptctl can read",
            hint="give the model's own config.json (--hf-config)",
        )
    for key in (*_REQUIRED, "num_key_value_heads", "head_dim"):
        _positive_count(config, key)
    bias = bool(config.get("attention_bias", False))
    if family.name == "llama" and bias != bool(config.get("mlp_bias", False)):
        raise LayoutError("attention_bias and mlp_bias differ: Megatron has one add_bias_linear")
    if family.name in ("qwen3", "qwen3_moe") and bias:
        raise LayoutError("attention_bias=true: Megatron cannot hold biases on attention only")
    if family.rules:
        fields = family.rules.spec_fields(config)
    else:
        fields = _moe_spec(config, family) | hf_windows.spec_fields(config, family.name)
        parameters = rope_scaling.hf_parameters_of(config)
        positions = config.get("max_position_embeddings", 4096)
        fields["rope_scaling"] = rope_scaling.from_hf(parameters, positions)
    return ModelSpec(**(_common_fields(config, family, make_vocab_size_divisible_by) | fields))


def _common_fields(
    config: Mapping[str, Any], family: Family, make_vocab_size_divisible_by: int
) -> dict[str, Any]:
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    bias = bool(config.get("attention_bias", False))
    return dict(
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
        elif key == "hidden_act" and family.name == hf_gemma.MODEL_TYPE:
            continue  # read with hidden_activation by hf_gemma
        elif (problem := _plain_problem(key, value, config)) is not None:
            changed.append(problem)
    refuse_fields(changed, unknown, f" for model_type {family.name!r}")


def _plain_problem(key: str, value: Any, config: Mapping[str, Any]) -> str | None:
    """The key=value that makes the model more than its family's plain form, if it does."""
    if key == "hidden_act" and value != "silu":
        return f"hidden_act={value!r}"
    if key in ("rope_scaling", "rope_parameters"):
        return None  # read whole: by a family's own rules, else ``rope_scaling.from_hf``
    if key == "decoder_sparse_step" and value != 1:
        return f"decoder_sparse_step={value!r} (dense layers between MoE layers)"
    if key == "mlp_only_layers" and value:
        return f"mlp_only_layers={value!r} (dense layers between MoE layers)"
    if key == "qkv_bias" and value is False:
        return "qkv_bias=False"
    return None
