"""Megatron's ``args`` and ckptctl's model spec and layout, both ways: which argument means what
(with Megatron's defaults), and the ``args`` a written checkpoint carries."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.formats.megatron_common import gemma_args, linear_args, release_args
from ckptctl.formats.megatron_common.args_fields import (
    HARMLESS,
    MAPPED,
    MLA_FIELDS,
    MOE_FIELDS,
    MOE_HARMLESS,
    MOE_MAPPED,
    MOE_PLAIN_VALUES,
    MTP_FIELDS,
    MTP_HARMLESS,
    MTP_PLAIN_VALUES,
    MUP_FIELDS,
    PLAIN_VALUES,
    RELATED_VALUES,
    VARIANT_FIELDS,
)
from ckptctl.formats.megatron_common.mla_args import (
    MLA_HARMLESS,
    MLA_MAPPED,
    MLA_PLAIN_VALUES,
    mla_args,
    mla_spec,
)
from ckptctl.formats.megatron_common.moe_args import moe_args, moe_spec
from ckptctl.model.catalog import Naming
from ckptctl.model.fields import refuse_fields
from ckptctl.model.layout import (
    Activation,
    ModelSpec,
    NormKind,
    ParallelLayout,
    PositionEmbedding,
)
from ckptctl.model.rope_scaling import RopeScaling, position_type
from ckptctl.model.rope_scaling import from_megatron as rope_from_megatron
from ckptctl.model.rope_scaling import megatron_args as rope_megatron_args
from ckptctl.model.windows import from_megatron, megatron_fields


def _arg(args: argparse.Namespace, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default


def _values(args: argparse.Namespace) -> Callable[..., Any]:
    """``value(name, default=None)``: one field of ``args``, as ``_arg`` reads it (for the
    feature modules that read their own fields)."""
    return lambda name, default=None: _arg(args, name, default=default)


def check_fields(args: argparse.Namespace, trusted: frozenset[str] = frozenset()) -> None:
    """Refuse, by name, every field of ``args`` the model spec cannot carry: a field that changes
    the math or the layout away from its plain value, and a field ckptctl cannot judge (not
    classified in ``args_fields`` and not at a default of any Megatron-LM release's parser)."""
    fields = vars(args)
    changed, unknown = [], []
    for name, value in fields.items():
        verdict = _verdict(name, value, fields, trusted)
        if verdict == "changed":
            changed.append(f"args.{name}={_shown(value)}")
        elif verdict == "unknown":
            unknown.append(f"args.{name}={_shown(value)}")
    refuse_fields(changed, unknown, " and not at a default of any Megatron-LM release it knows")


def _verdict(name: str, value: Any, fields: dict[str, Any], trusted: frozenset[str]) -> str:
    """``ok``, ``changed`` (math- or layout-changing, at a value ckptctl cannot carry) or
    ``unknown``."""
    if name in trusted or name in MAPPED or name in HARMLESS:
        return "ok"
    moe = bool(fields.get("num_experts"))
    if fields.get("multi_latent_attention"):
        if name in MLA_MAPPED or name in MLA_HARMLESS:
            return "ok"  # read by mla_spec, which refuses what it cannot carry
        if name in MLA_PLAIN_VALUES:
            return "ok" if _plain(value, MLA_PLAIN_VALUES[name]) else "changed"
    if fields.get("mtp_num_layers"):
        if name in MTP_HARMLESS:
            return "ok"
        if name in MTP_PLAIN_VALUES:
            return "ok" if _plain(value, MTP_PLAIN_VALUES[name]) else "changed"
    if moe and (name in MOE_MAPPED or name in MOE_HARMLESS):
        return "ok"
    if moe and name in MOE_PLAIN_VALUES:
        return "ok" if _plain(value, MOE_PLAIN_VALUES[name]) else "changed"
    if name in PLAIN_VALUES:
        return "ok" if _plain(value, PLAIN_VALUES[name]) else "changed"
    if name in RELATED_VALUES:
        related = tuple(fields.get(other) for other in RELATED_VALUES[name])
        return "ok" if _plain(value, (None, *related)) else "changed"
    if name in _dormant(fields):
        return "ok"  # read by Megatron only when a switch is on, and it is off
    if release_args.at_default(name, value):
        return "ok"  # a field ckptctl need not know: at a Megatron-LM default it is inert
    return "unknown"


def _dormant(fields: dict[str, Any]) -> frozenset[str]:
    """Fields Megatron reads only with a feature whose switch is off in ``fields``."""
    dormant: set[str] = set()
    if not fields.get("num_experts"):
        dormant |= MOE_FIELDS
    if not fields.get("multi_latent_attention"):
        dormant |= MLA_FIELDS
    if not fields.get("experimental_attention_variant") and not fields.get("linear_attention_freq"):
        dormant |= VARIANT_FIELDS
    if not fields.get("mtp_num_layers"):
        dormant |= MTP_FIELDS
    if not fields.get("use_mup"):
        dormant |= MUP_FIELDS
    return frozenset(dormant)


def _plain(value: Any, plain_values: tuple[object, ...]) -> bool:
    plain = release_args.plain_value(value)
    return any(release_args.same(plain, other) for other in plain_values)


def _shown(value: Any) -> str:
    """A field's value for an error line: short, whatever the checkpoint holds."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def grad_reduce_dtype(args: argparse.Namespace) -> str | None:
    """The dtype Megatron's grad buffers reduce in when it is not fp32 (``None``): the
    parameters' own for fp16 or bf16 runs without ``accumulate_allreduce_grads_in_fp32`` (which
    ``validate_args`` sets for bf16 unless ``--grad-reduce-in-bf16``). It names the distributed
    optimizer's grad buffers, ``(param dtype, grad dtype)``."""
    weight = "float16" if _arg(args, "fp16") else "bfloat16" if _arg(args, "bf16") else None
    if weight is None or _arg(args, "accumulate_allreduce_grads_in_fp32", default=False):
        return None
    return weight


def eod_row_note(args: argparse.Namespace, spec: ModelSpec, tp: int) -> str | None:
    """Where Megatron-LM's ``NullTokenizer`` put its end-of-document token, when it may lie
    past the vocabulary the args give (a padding row to ckptctl, which a target without
    padding rows, HF, leaves out): the legacy tokenizer's is row ``vocab_size``; megatron-core's
    tokenizer library (whose releases record ``null_tokenizer_eod_id``) keeps it inside
    (``vocab_size - 1``, or the id given). Releases that record neither may have run either."""
    if _arg(args, "tokenizer_type") != "NullTokenizer":
        return None
    if spec.padded_vocab_size(tp) <= spec.vocab_size:
        return None
    legacy = bool(_arg(args, "legacy_tokenizer", default=False))
    if not legacy and hasattr(args, "null_tokenizer_eod_id"):
        return None
    which = "its legacy tokenizer" if legacy else "Megatron-LM's legacy tokenizer, if it ran"
    return (
        f"NullTokenizer: {which} ends documents with token {spec.vocab_size}, one row past "
        f"vocab_size (a padding row here); pass --true-vocab-size {spec.vocab_size + 1} to "
        "keep it in an HF output"
    )


def naming_from_args(args: argparse.Namespace) -> Naming | None:
    """The parameter spelling Megatron-LM loads with, from ``args.transformer_impl`` (None when
    the args do not say)."""
    impl = getattr(args, "transformer_impl", None)
    if impl is None:
        return None
    if impl not in _IMPL_NAMING:
        raise LayoutError(
            f"args.transformer_impl={impl!r}: not supported yet (ckptctl knows "
            f"{', '.join(map(repr, _IMPL_NAMING))})"
        )
    return _IMPL_NAMING[impl]


_IMPL_NAMING = {"transformer_engine": Naming.TE, "local": Naming.LOCAL}


def _activation(args: argparse.Namespace) -> tuple[bool, Activation]:
    """(gated, activation) as Megatron-LM's ``core_transformer_config_from_args`` sets them."""
    if getattr(args, "swiglu", False):
        return True, Activation.SILU
    if getattr(args, "quick_geglu", False):
        return True, Activation.QUICK_GELU
    if getattr(args, "squared_relu", False):
        return False, Activation.SQUARED_RELU
    tanh = gemma_args.activation(_values(args))
    return tanh or (False, Activation.GELU)


def _position_embedding(args: argparse.Namespace) -> PositionEmbedding:
    value = _arg(args, "position_embedding_type", default="learned_absolute")
    if value == "yarn" and not getattr(args, "multi_latent_attention", False):
        value = "rope"  # stretched by YaRN: the spec's rope_scaling
    if getattr(args, "use_rotary_position_embeddings", False):
        value = "rope"  # the flag that predates position_embedding_type
    if value == "learned_absolute" and getattr(args, "add_position_embedding", True) is False:
        value = "none"  # --no-position-embedding
    try:
        return PositionEmbedding(str(value))
    except ValueError:
        raise LayoutError(f"args.position_embedding_type={value!r}: not supported yet") from None


def query_groups(args: argparse.Namespace, heads: int) -> int:
    """Key/value head groups as Megatron-LM builds the model: with ``group_query_attention``
    off it ignores ``num_query_groups`` (often stored as 1) and uses one group per head. Only
    ``args`` that predate the flag are taken at their ``num_query_groups``."""
    gqa = getattr(args, "group_query_attention", None)
    if gqa is not None and not gqa:
        return heads
    return int(_arg(args, "num_query_groups", default=heads))


def spec_from_args(
    args: argparse.Namespace,
    true_vocab_size: int | None = None,
    trusted: frozenset[str] = frozenset(),
) -> ModelSpec:
    """Megatron's argument names (and defaults) to a ``ModelSpec``; every other field is
    checked by ``check_fields``."""
    for flag in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(args, flag, False):
            raise LayoutError(f"args.{flag} is set: this pipeline split is not supported yet")
    if getattr(args, "pipeline_model_parallel_layout", None):
        raise LayoutError("args.pipeline_model_parallel_layout is set: not supported yet")
    check_fields(args, trusted)
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
    if norm not in {kind.value for kind in NormKind}:
        raise LayoutError(f"args.normalization={norm!r}: not supported yet")
    gated, activation = _activation(args)
    naming_from_args(args)  # refuses a transformer_impl ckptctl cannot spell
    return ModelSpec(
        num_layers=args.num_layers,
        hidden_size=hidden,
        ffn_hidden_size=_arg(args, "ffn_hidden_size", default=4 * hidden),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=_arg(args, "kv_channels", default=hidden // heads),
        vocab_size=vocab,
        make_vocab_size_divisible_by=_arg(args, "make_vocab_size_divisible_by", default=128),
        gated_linear_unit=gated,
        activation=activation,
        add_bias_linear=bool(_arg(args, "add_bias_linear", default=True)),
        add_qkv_bias=bool(_arg(args, "add_qkv_bias", default=False)),
        tie_embeddings=not _arg(args, "untie_embeddings_and_output_weights", default=False),
        normalization=NormKind(norm),
        position_embedding=_position_embedding(args),
        max_position_embeddings=_arg(args, "max_position_embeddings", default=4096),
        norm_epsilon=float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        rotary_base=float(_arg(args, "rotary_base", default=10000)),
        rotary_percent=float(_arg(args, "rotary_percent", default=1.0)),
        qk_layernorm=bool(_arg(args, "qk_layernorm", default=False)),
        hf_family=_arg(args, "ckptctl_hf_family"),
        mla=mla_spec(args),
        mtp_num_layers=int(_arg(args, "mtp_num_layers", default=0)),
        rope_scaling=_rope_scaling(args),
        glu_linear_offset=_number(args, "glu_linear_offset"),
        activation_clamp=_clamp(args),
        attention_sinks=_softmax_type(args) == "learnable",
        softmax_off_by_one=_softmax_type(args) == "off-by-one",
        **gemma_args.spec_fields(_values(args)),
        **linear_args.spec_fields(_values(args), args.num_layers),
        **moe_spec(_values(args), args.num_layers),
        **from_megatron(
            _arg(args, "window_size"), _arg(args, "window_attn_skip_freq"), args.num_layers
        ),
    )


def _clamp(args: argparse.Namespace) -> float | None:
    value = _arg(args, "activation_func_clamp_value")
    return None if value is None else _number(args, "activation_func_clamp_value")


def _number(args: argparse.Namespace, name: str, default: float = 0.0) -> float:
    value = _arg(args, name, default=default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"args.{name}={value!r} is not a number")
    return float(value)


def _softmax_type(args: argparse.Namespace) -> str:
    """``softmax_type``: vanilla, off-by-one (a 1 in the denominator) or learnable (a learned
    logit per head there)."""
    kind = _arg(args, "softmax_type", default="vanilla")
    if kind not in ("vanilla", "off-by-one", "learnable"):
        raise LayoutError(f"args.softmax_type={kind!r}: not supported yet")
    return str(kind)


def _rope_scaling(args: argparse.Namespace) -> RopeScaling | None:
    if getattr(args, "multi_latent_attention", False):
        return None  # its YaRN is the MLA spec's
    position = str(_arg(args, "position_embedding_type", default="learned_absolute"))
    return rope_from_megatron(_values(args), position)


MOST_ITERATIONS = 1 << 48
"""Largest training iteration a checkpoint may claim (a step a microsecond for nine years)."""


def checked_iteration(value: Any, where: str, directory: int | None = None) -> int | None:
    """A checkpoint's ``iteration`` counter as it may be carried into outputs: a non-negative
    integer (``None`` only where the file holds none), and the number of the directory it was
    saved in, when that has one. Anything else is refused, never copied."""
    if value is None and directory is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MOST_ITERATIONS:
        raise CheckpointError(
            f"{where}: iteration={value!r} is not an iteration number; the file is corrupt or "
            "was not written by a training run"
        )
    if directory is not None and value != directory:
        raise CheckpointError(
            f"{where}: iteration={value} disagrees with its directory's iteration {directory}"
        )
    return value


def check_saved_layout(
    args: argparse.Namespace, spec: ModelSpec, layout: ParallelLayout, where: str
) -> None:
    """The layout ``args`` say the checkpoint was saved with must be able to split the model,
    and the padded vocabulary they record must be the model's at that TP size."""
    try:
        layout.check_against(spec)
    except LayoutError as err:
        raise CheckpointError(f"{where}: args describe an impossible layout: {err}") from None
    world = getattr(args, "world_size", None)
    context = getattr(args, "context_parallel_size", None) or 1
    if isinstance(world, int) and world != layout.tp * layout.pp * context * layout.dp:
        raise CheckpointError(
            f"{where}: args.world_size={world} is not tensor x pipeline x context x data "
            f"parallel ({layout.tp} x {layout.pp} x {context} x {layout.dp}); the args "
            "disagree with themselves"
        )
    padded = getattr(args, "padded_vocab_size", None)
    if padded is not None and padded != spec.padded_vocab_size(layout.tp):
        raise CheckpointError(
            f"{where}: args.padded_vocab_size={padded} does not match vocab_size="
            f"{spec.vocab_size} padded for tp={layout.tp} ({spec.padded_vocab_size(layout.tp)}); "
            "pass --true-vocab-size"
        )


def layout_from_args(args: argparse.Namespace) -> ParallelLayout:
    moe = bool(_arg(args, "num_experts"))
    etp = _arg(args, "expert_tensor_parallel_size") if moe else None
    tp = _arg(args, "tensor_model_parallel_size", default=1)
    return ParallelLayout(
        ep=_arg(args, "expert_model_parallel_size", default=1) if moe else 1,
        etp=None if etp == tp else etp,
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
    gated = (Activation.SILU, Activation.QUICK_GELU, Activation.GELU_TANH)
    if spec.gated_linear_unit and spec.activation not in gated:
        raise LayoutError(
            f"a gated {spec.activation} MLP: Megatron's args can only express SwiGLU, "
            "quick-GEGLU and Gemma's GEGLU (tanh)"
        )
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
        swiglu=spec.gated_linear_unit and spec.activation is Activation.SILU,
        quick_geglu=spec.gated_linear_unit and spec.activation is Activation.QUICK_GELU,
        glu_linear_offset=spec.glu_linear_offset,
        activation_func_clamp_value=spec.activation_clamp,
        softmax_type=(
            "learnable"
            if spec.attention_sinks
            else "off-by-one"
            if spec.softmax_off_by_one
            else "vanilla"
        ),
        squared_relu=spec.activation is Activation.SQUARED_RELU,
        qk_layernorm=spec.qk_layernorm,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        untie_embeddings_and_output_weights=not spec.tie_embeddings,
        normalization=spec.normalization.value,
        position_embedding_type=position_type(spec.rope_scaling, spec.position_embedding.value),
        max_position_embeddings=spec.max_position_embeddings,
        norm_epsilon=spec.norm_epsilon,
        rotary_base=spec.rotary_base,
        rotary_percent=spec.rotary_percent,
        **moe_args(spec),
        **mla_args(spec.mla),
        mtp_num_layers=spec.mtp_num_layers or None,
        **megatron_fields(spec),
        **rope_megatron_args(spec.rope_scaling),
        **gemma_args.args_fields(spec),
        **linear_args.args_fields(spec),
        transformer_impl="transformer_engine",
        ckptctl_hf_family=spec.hf_family,
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
    # Megatron-LM's own names for them, when the source's args have those (read first by both)
    if hasattr(out, "decoder_first_pipeline_num_layers"):
        out.decoder_first_pipeline_num_layers = layout.first_stage_layers
    if hasattr(out, "decoder_last_pipeline_num_layers"):
        out.decoder_last_pipeline_num_layers = layout.last_stage_layers
    out.padded_vocab_size = spec.padded_vocab_size(layout.tp)
    out.use_distributed_optimizer = layout.distributed_optimizer
    if spec.is_moe:
        out.expert_model_parallel_size = layout.ep
        out.expert_tensor_parallel_size = layout.expert_tp
    # Megatron-LM 0.19's weight-shard counts follow TP (and expert TP): kept so where set
    if getattr(out, "tensor_parallel_num_weight_shards", None) is not None:
        out.tensor_parallel_num_weight_shards = layout.tp
    if getattr(out, "expert_tensor_parallel_num_weight_shards", None) is not None:
        out.expert_tensor_parallel_num_weight_shards = layout.expert_tp
    if getattr(out, "vocab_size", None) is None:
        out.vocab_size = spec.vocab_size
    if hasattr(out, "data_parallel_size"):
        out.data_parallel_size = layout.dp
    if hasattr(out, "world_size"):
        out.world_size = layout.tp * layout.pp * layout.dp
    return out
