"""Megatron's ``args`` and ckptctl's model spec and layout, both ways: which argument means what
(with Megatron's defaults), and the ``args`` a written checkpoint carries."""

from __future__ import annotations

import argparse
import copy
from typing import Any

from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.model.layout import ModelSpec, NormKind, ParallelLayout, PositionEmbedding


def _arg(args: argparse.Namespace, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default


PLAIN_VALUES: dict[str, tuple[object, ...]] = {
    "qk_layernorm": (False, None),
    "multi_latent_attention": (False, None),
    "mtp_num_layers": (None, 0),
    "apply_layernorm_1p": (False, None),
    "squared_relu": (False, None),
    "use_rope_scaling": (False, None),
    "window_size": (None,),
    "heterogeneous_layers_config_path": (None, ""),
    "heterogeneous_layers_config_encoded_json": (None, ""),
    "rotary_interleaved": (False, None),
    "no_rope_freq": (None,),
}
"""``args`` fields that change the computation or the tensor layout and that ckptctl does not
map into the model spec: a checkpoint whose value is anything but these is refused by name
(exit 0 with wrong weights is the worst outcome there is)."""


def refuse_unmapped(args: argparse.Namespace) -> None:
    """Refuse, by name, every math-changing field of ``args`` that the spec cannot carry."""
    problems = []
    for field, plain in PLAIN_VALUES.items():
        value = getattr(args, field, None)
        if value not in plain:
            problems.append(f"args.{field}={value!r}")
    if problems:
        raise LayoutError(
            f"{', '.join(problems)}: not supported yet (these change the model's math or "
            "tensor layout); ckptctl refuses rather than convert it wrong"
        )


def query_groups(args: argparse.Namespace, heads: int) -> int:
    """Key/value head groups as Megatron-LM builds the model: with ``group_query_attention``
    off it ignores ``num_query_groups`` (often stored as 1) and uses one group per head. Only
    ``args`` that predate the flag are taken at their ``num_query_groups``."""
    gqa = getattr(args, "group_query_attention", None)
    if gqa is not None and not gqa:
        return heads
    return int(_arg(args, "num_query_groups", default=heads))


def spec_from_args(args: argparse.Namespace, true_vocab_size: int | None = None) -> ModelSpec:
    """Megatron's argument names (and defaults) to a ``ModelSpec``."""
    for flag in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(args, flag, False):
            raise LayoutError(f"args.{flag} is set: this pipeline split is not supported yet")
    if getattr(args, "pipeline_model_parallel_layout", None):
        raise LayoutError("args.pipeline_model_parallel_layout is set: not supported yet")
    refuse_unmapped(args)
    hidden = _arg(args, "hidden_size")
    heads = _arg(args, "num_attention_heads")
    if hidden is None or heads is None or _arg(args, "num_layers") is None:
        raise CheckpointError("args lacks num_layers / hidden_size / num_attention_heads")
    groups = query_groups(args, heads)
    padded = _arg(args, "padded_vocab_size")
    vocab = true_vocab_size or _arg(args, "vocab_size", "ckptctl_true_vocab_size", default=padded)
    if vocab is None:
        raise CheckpointError("args has neither padded_vocab_size nor vocab_size")
    norm = str(_arg(args, "normalization", default="LayerNorm"))
    position = str(_arg(args, "position_embedding_type", default="learned_absolute"))
    return ModelSpec(
        num_layers=args.num_layers,
        hidden_size=hidden,
        ffn_hidden_size=_arg(args, "ffn_hidden_size", default=4 * hidden),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=_arg(args, "kv_channels", default=hidden // heads),
        vocab_size=vocab,
        make_vocab_size_divisible_by=_arg(args, "make_vocab_size_divisible_by", default=128),
        gated_linear_unit=bool(_arg(args, "swiglu", default=False)),
        add_bias_linear=bool(_arg(args, "add_bias_linear", default=True)),
        add_qkv_bias=bool(_arg(args, "add_qkv_bias", default=False)),
        tie_embeddings=not _arg(args, "untie_embeddings_and_output_weights", default=False),
        normalization=NormKind(norm),
        position_embedding=PositionEmbedding(position),
        max_position_embeddings=_arg(args, "max_position_embeddings", default=4096),
        norm_epsilon=float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        rotary_base=float(_arg(args, "rotary_base", default=10000)),
        rotary_percent=float(_arg(args, "rotary_percent", default=1.0)),
        num_experts=_arg(args, "num_experts"),
    )


def layout_from_args(args: argparse.Namespace) -> ParallelLayout:
    if (_arg(args, "expert_model_parallel_size", default=1) or 1) > 1:
        raise LayoutError("expert parallelism (EP > 1) is not yet supported")
    return ParallelLayout(
        tp=_arg(args, "tensor_model_parallel_size", default=1),
        pp=_arg(args, "pipeline_model_parallel_size", default=1),
        dp=_arg(args, "data_parallel_size", default=1),
        vpp=_arg(args, "virtual_pipeline_model_parallel_size", default=1),
        first_stage_layers=_arg(
            args, "num_layers_in_first_pipeline_stage", "decoder_first_pipeline_num_layers"
        ),
        last_stage_layers=_arg(
            args, "num_layers_in_last_pipeline_stage", "decoder_last_pipeline_num_layers"
        ),
        distributed_optimizer=bool(_arg(args, "use_distributed_optimizer", default=False)),
    )


def args_from_spec(spec: ModelSpec) -> argparse.Namespace:
    """Megatron arguments describing ``spec``, for checkpoints cut from a full HF model."""
    return argparse.Namespace(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        group_query_attention=spec.num_query_groups != spec.num_attention_heads,
        kv_channels=spec.kv_channels,
        vocab_size=spec.vocab_size,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        swiglu=spec.gated_linear_unit,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        untie_embeddings_and_output_weights=not spec.tie_embeddings,
        normalization=spec.normalization.value,
        position_embedding_type=spec.position_embedding.value,
        max_position_embeddings=spec.max_position_embeddings,
        norm_epsilon=spec.norm_epsilon,
        rotary_base=spec.rotary_base,
        rotary_percent=spec.rotary_percent,
        num_experts=spec.num_experts,
        data_parallel_size=1,
        world_size=1,
    )


def args_for(
    args: argparse.Namespace, spec: ModelSpec, layout: ParallelLayout
) -> argparse.Namespace:
    """A copy of ``args`` describing ``layout`` (sizes, padded vocabulary, uneven stages)."""
    out = copy.copy(args)
    out.tensor_model_parallel_size = layout.tp
    out.pipeline_model_parallel_size = layout.pp
    out.virtual_pipeline_model_parallel_size = layout.vpp if layout.vpp > 1 else None
    out.num_layers_in_first_pipeline_stage = layout.first_stage_layers
    out.num_layers_in_last_pipeline_stage = layout.last_stage_layers
    out.padded_vocab_size = spec.padded_vocab_size(layout.tp)
    out.use_distributed_optimizer = layout.distributed_optimizer
    if getattr(out, "vocab_size", None) is None:
        out.vocab_size = spec.vocab_size
    if hasattr(out, "data_parallel_size"):
        out.data_parallel_size = layout.dp
    if hasattr(out, "world_size"):
        out.world_size = layout.tp * layout.pp * layout.dp
    return out
