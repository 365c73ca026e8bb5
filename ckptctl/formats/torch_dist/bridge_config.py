"""Megatron-Bridge's training checkpoints: ``torch_dist`` without Megatron-LM's ``args``. Pure.

Megatron-Bridge (NVIDIA's trainer for the families Megatron-LM's own scripts do not build:
Qwen3-Next, Gemma 3, GPT-OSS, ...) saves ``iter_N/`` as megatron-core's ``torch_dist`` with a
``common.pt`` holding no ``args``; the run's whole ``ConfigContainer`` is ``iter_N/run_config.yaml``
(``ConfigContainer.to_yaml``). Its ``model`` section is the model provider: a
``TransformerConfig`` subclass whose fields are megatron-core's names, most of them Megatron-LM's
argument names too, functions and dtypes written as ``{_target_: ...}`` mappings.

The section is read into Megatron-LM's ``args`` field by field, then judged as any checkpoint's
``args`` are (``spec_from_args``: a field that changes the model away from its plain value, or
that nothing here classifies, is refused by name):

* the provider class must be one that describes the model by its fields alone (the GPT
  provider, Qwen's and Llama's but Llama 4's); others build layers of their own and are refused;
* the layer spec function becomes ``transformer_impl`` (Megatron-Bridge's default chooses
  TransformerEngine where it is installed, as on every GPU it trains on);
* the activation function and ``gated_linear_unit`` become Megatron-LM's activation flags;
* renamed fields (``num_moe_experts``, ``share_embeddings_and_output_weights``, ``rope_scaling``,
  the YaRN factors) take Megatron-LM's names; the vocabulary is padded only with
  ``should_pad_vocab``;
* runtime objects (initialisers, dtypes, hooks) are dropped; ``BRIDGE_HARMLESS`` fields (kernel,
  communication and offloading switches Megatron-LM's args lack) are dropped; ``BRIDGE_PLAIN``
  fields are accepted at their plain value only.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from ckptctl.errors import CheckpointError, LayoutError

RUN_CONFIG = "run_config.yaml"
TARGET = "_target_"

PROVIDER_MODULES = {
    "megatron.bridge.models.gpt_provider": ("GPTModelProvider",),
    "megatron.bridge.models.qwen.qwen_provider": ("Qwen",),
    "megatron.bridge.models.llama.llama_provider": ("Llama2", "Llama3", "CodeLlama", "LlamaModel"),
    "megatron.bridge.models.gpt_oss.gpt_oss_provider": ("GPTOSSProvider",),
}
"""Provider classes (by module, then class-name prefixes) that add nothing to the model but
their fields' values (GPT-OSS's picks an attention backend, no math): Llama 4's (chunked
attention, layers without RoPE) is not among them."""

YARN = {
    "yarn_rotary_scaling_factor": "rotary_scaling_factor",
    "yarn_mscale": "mscale",
    "yarn_mscale_all_dim": "mscale_all_dim",
}
"""The provider's YaRN fields (read by GPTModel with ``position_embedding_type: yarn``) that
Megatron-LM's args name otherwise."""

LAYER_SPECS = {
    "megatron.bridge.models.gpt_provider.default_layer_spec": "transformer_engine",
    "megatron.bridge.models.gpt_provider.transformer_engine_layer_spec": "transformer_engine",
    "megatron.bridge.models.gpt_provider.local_layer_spec": "local",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs."
    "get_transformer_block_with_experimental_attention_variant_spec": "transformer_engine",
}
"""The layer spec functions whose modules ckptctl spells, and the ``transformer_impl`` each is."""

ACTIVATIONS: dict[tuple[str, bool], dict[str, bool]] = {
    ("torch.nn.functional.silu", True): {"swiglu": True},
    ("torch.nn.functional.gelu", False): {},
    ("torch._C._nn.gelu", False): {},  # how the YAML spells torch's built-in GELU
    ("megatron.core.activations.squared_relu", False): {"squared_relu": True},
    ("megatron.core.fusions.fused_bias_geglu.quick_gelu", True): {"quick_geglu": True},
    ("megatron.core.activations.quick_gelu", True): {"quick_geglu": True},
}
"""(activation function, gated) -> Megatron-LM's flags for it (GELU is its default)."""

OBJECTS = frozenset(
    """init_method output_layer_init_method embedding_init_method attention_backend
    autocast_dtype params_dtype pipeline_dtype finalize_model_grads_func grad_scale_func
    grad_sync_func param_sync_func no_sync_func timers""".split()  # noqa: SIM905
)
"""Runtime objects of the config (initialisers, dtypes: the stored tensors carry their own,
kernels' backends, training hooks): none decides what a stored tensor means."""

BRIDGE_HARMLESS = frozenset(
    """activation_func_fp8_input_store batch_p2p_comm batch_p2p_sync bias_activation_fusion
    cpu_offloading_activations cpu_offloading_double_buffering cpu_offloading_weights
    cuda_graph_retain_backward_graph cuda_graph_use_single_mempool deallocate_pipeline_outputs
    disable_parameter_transpose_cache enable_autocast fp8_dot_product_attention
    fp8_multi_head_attention fused_single_qkv_rope hetereogenous_dist_checkpoint hf_model_id
    inference_sampling_seed memory_efficient_layer_norm mtp_enabled
    num_microbatches_with_partial_activation_checkpoints parallel_output persist_layer_norm
    scatter_embedding_sequence_parallel tp_comm_atomic_ag tp_comm_atomic_rs
    tp_comm_overlap_disable_fc1 tp_comm_overlap_disable_qkv tp_only_amax_red
    use_inference_optimized_layers use_te_rng_tracker generation_config
    use_arbitrary_attention_mask""".split()  # noqa: SIM905
)
"""Provider and ``TransformerConfig`` fields Megatron-LM's args lack that change neither the
stored tensors nor the math: kernels, communication overlap, offloading, CUDA graphs, how
``torch_dist`` numbers its layer keys (``hetereogenous_dist_checkpoint``: read as stored), the
HF id it came from, ``mtp_enabled`` (derived from ``mtp_num_layers``)."""

BRIDGE_PLAIN: dict[str, tuple[object, ...]] = {
    "heterogeneous_block_specs": (False,),
    "use_transformer_engine_full_layer_spec": (False,),
    "use_kitchen": (False,),
    "quant_recipe": (None,),
    "restore_modelopt_state": (False,),
    "softmax_scale": (None,),
    "seq_len_interpolation_factor": (None,),
    "moe_router_topk_limited_devices": (None,),
    "moe_token_dropping": (False,),
    "fp8_param": (False,),
}
"""Fields Megatron-LM's args lack that change the model (its layers, attention scale, RoPE,
routing, stored precision) unless at the value here: refused at any other."""

CONSUMED = frozenset(
    """activation_func gated_linear_unit transformer_layer_spec num_moe_experts
    share_embeddings_and_output_weights rope_scaling vocab_size should_pad_vocab
    make_vocab_size_divisible_by max_position_embeddings yarn_rotary_scaling_factor yarn_mscale
    yarn_mscale_all_dim window_size""".split()  # noqa: SIM905
)


def sections(text: str, where: str) -> dict[str, Any]:
    """A ``run_config.yaml`` (plain YAML: no object is constructed), with its ``model``."""
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise CheckpointError(f"{where}: not YAML ({str(err).splitlines()[0]})") from None
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError(f"{where}: no 'model' section, which Megatron-Bridge writes")
    return config


def model_section(text: str, where: str) -> dict[str, Any]:
    """The ``model`` mapping of a ``run_config.yaml``."""
    model: dict[str, Any] = sections(text, where)["model"]
    return model


DDP_ARGS = {
    "overlap_grad_reduce": "overlap_grad_reduce",
    "bucket_size": "ddp_bucket_size",
    "grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32",
    "use_distributed_optimizer": "use_distributed_optimizer",
}
"""The ``ddp`` section's fields that lay out the grad buffers (where ``dp_reshardable``
optimizer state lies), by Megatron-LM's argument names."""


def ddp_args(config: dict[str, Any]) -> dict[str, Any] | None:
    """Megatron-LM's arguments for the run's grad buffers, from its ``ddp`` section; ``None``
    when it does not say them all, or pads buckets for NCCL's bus bandwidth (a layout ckptctl
    does not replay)."""
    ddp = config.get("ddp")
    if not isinstance(ddp, dict) or any(field not in ddp for field in DDP_ARGS):
        return None
    if ddp.get("pad_buckets_for_high_nccl_busbw"):
        return None
    return {name: ddp[field] for field, name in DDP_ARGS.items()}


def args_from_model(model: dict[str, Any], where: str) -> argparse.Namespace:
    """Megatron-LM's ``args`` for a run whose ``run_config.yaml`` model section is ``model``."""
    provider = str(model.get(TARGET, ""))
    module, _, name = provider.rpartition(".")
    if not name.startswith(PROVIDER_MODULES.get(module, ())):
        raise LayoutError(
            f"{where}: model._target_={provider!r}: ckptctl reads the models of "
            "Megatron-Bridge's GPT, Qwen and Llama (not Llama 4) providers, which are their "
            "fields alone; this provider builds layers of its own"
        )
    problems = []
    fields: dict[str, Any] = {}
    for key, value in model.items():
        if key == TARGET or key in CONSUMED or key in OBJECTS or key in BRIDGE_HARMLESS:
            continue
        if key in BRIDGE_PLAIN:
            if value not in BRIDGE_PLAIN[key]:
                plain = BRIDGE_PLAIN[key][0]
                problems.append(f"model.{key}={value!r} changes the model (read at {plain!r} only)")
            continue
        if isinstance(value, dict):
            problems.append(
                f"model.{key} is {value.get(TARGET, value)!r}, which ckptctl cannot judge"
            )
            continue
        fields[key] = value
    fields |= _activation(model, problems)
    fields["transformer_impl"] = _impl(model, problems)
    fields |= _renamed(model)
    if problems:
        raise LayoutError(f"{where}: " + "; ".join(problems))
    return argparse.Namespace(**fields)


def _target(value: Any) -> str | None:
    return str(value[TARGET]) if isinstance(value, dict) and TARGET in value else None


def _activation(model: dict[str, Any], problems: list[str]) -> dict[str, bool]:
    function = _target(model.get("activation_func")) or "torch.nn.functional.gelu"  # the default
    gated = bool(model.get("gated_linear_unit", False))
    flags = ACTIVATIONS.get((function, gated))
    if flags is None:
        problems.append(f"model.activation_func={function!r} with gated_linear_unit={gated}")
        return {}
    return flags


def _impl(model: dict[str, Any], problems: list[str]) -> str:
    spec = _target(model.get("transformer_layer_spec")) or next(iter(LAYER_SPECS))
    impl = LAYER_SPECS.get(spec)
    if impl is None:
        problems.append(f"model.transformer_layer_spec={spec!r}: a layer spec ckptctl cannot spell")
        return "transformer_engine"
    return impl


def _renamed(model: dict[str, Any]) -> dict[str, Any]:
    """Fields Megatron-LM names otherwise, and the vocabulary: the provider's ``vocab_size`` is
    the true one, padded as Megatron-LM pads only with ``should_pad_vocab``."""
    out: dict[str, Any] = {
        "num_experts": model.get("num_moe_experts"),
        "untie_embeddings_and_output_weights": not model.get(
            "share_embeddings_and_output_weights", True
        ),
        "use_rope_scaling": bool(model.get("rope_scaling", False)),
        "vocab_size": model.get("vocab_size"),
        # the GPT provider builds GPTModel with max_sequence_length=seq_length
        "max_position_embeddings": model.get("max_position_embeddings", model.get("seq_length")),
        "make_vocab_size_divisible_by": (
            model.get("make_vocab_size_divisible_by", 128) if model.get("should_pad_vocab") else 1
        ),
    }
    window = model.get("window_size")
    out["window_size"] = tuple(window) if isinstance(window, list) else window  # YAML's tuple
    if model.get("position_embedding_type") == "yarn" and not model.get("multi_latent_attention"):
        out |= {megatron: model[name] for name, megatron in YARN.items() if name in model}
    return out
