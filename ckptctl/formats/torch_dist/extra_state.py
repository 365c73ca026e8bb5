"""The empty ``_extra_state`` items megatron-core's TransformerEngine modules save beside
their parameters in ``torch_dist`` checkpoints, keyed as the layers are. Pure."""

from __future__ import annotations

from ckptctl.formats.megatron_common.sharded_keys import EXPERTS_KEY, numbered_layers
from ckptctl.model.catalog import LAYER_PREFIX, MTP_INNER, MTP_PREFIX, layer_kind, layer_kinds
from ckptctl.model.layout import ModelSpec

EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "self_attention.core_attention",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
"""Layer modules whose ``_extra_state`` (TransformerEngine FP8 metadata) Megatron-Core asks for
when loading: written empty, as Megatron-Core itself writes it without FP8, so strict loads find
every key (``core_attention`` only TE layers ask for; others ignore it as unexpected). An MoE
layer has shared experts' linears instead of ``mlp.linear_fc*``, and per-expert linears whose
extra state is an ``(L, E)`` grid."""


_MLA_QUERIES = ("linear_q_down_proj", "linear_q_up_proj")
"""Multi-latent attention's linears in place of ``linear_qkv`` (``linear_q_proj`` when queries
are not compressed)."""


def _extra_state_modules(spec: ModelSpec, moe: bool, linear: bool = False) -> tuple[str, ...]:
    modules: tuple[str, ...] = EXTRA_STATE_MODULES
    if linear:  # a gated delta net's TE linears (no core attention module)
        modules = ("self_attention.in_proj", "self_attention.out_proj", *modules[3:])
    elif spec.mla is not None:
        queries = ("linear_q_proj",) if spec.mla.q_lora_rank is None else _MLA_QUERIES
        attention = (*queries, "linear_kv_down_proj", "linear_kv_up_proj")
        modules = (*(f"self_attention.{m}" for m in attention), *modules[1:])
    if moe:
        modules = modules[: len(modules) - 2]
        if spec.moe_shared_expert_intermediate_size:
            modules += ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
    return modules


def mtp_extra_state_keys(
    spec: ModelSpec, experts: range = range(0), dense: bool = True
) -> list[str]:
    """Empty ``_extra_state`` items of the MTP layers (their projection, their transformer
    layer's modules and its ``experts``), keyed like a numbered layer's."""
    keys: list[str] = []
    total = spec.num_experts or 0
    modules = _extra_state_modules(spec, spec.mtp_is_moe)
    for k in range(spec.mtp_num_layers):
        head, inner = f"{MTP_PREFIX}{k}.", f"{MTP_PREFIX}{k}.{MTP_INNER}."
        if dense:
            keys.append(f"{head}eh_proj._extra_state/shard_0_1")
            keys.extend(f"{inner}{module}._extra_state/shard_0_1" for module in modules)
        if spec.mtp_is_moe:
            keys.extend(
                f"{inner}{EXPERTS_KEY}{linear}._extra_state/shard_{expert}_{total}"
                for expert in experts
                for linear in ("linear_fc1", "linear_fc2")
            )
    return keys


def extra_state_keys(
    spec: ModelSpec, layers: list[int], experts: range = range(0), dense: bool = True
) -> list[str]:
    """Empty ``_extra_state`` items of ``layers``: the dense modules' (``dense``) and the
    ``experts``' own."""
    kinds = {kind: _extra_state_modules(spec, *kind) for kind in layer_kinds(spec)}
    keys: list[str] = []
    total_experts = spec.num_experts or 0
    linears = ("linear_fc1", "linear_fc2")
    for layer in layers:
        moe, kind = spec.is_moe_layer(layer), layer_kind(spec, layer)
        if numbered_layers(spec):  # layers of several kinds: each keyed by its number
            prefix = f"{LAYER_PREFIX}{layer}."
            if dense:
                keys.extend(f"{prefix}{module}._extra_state/shard_0_1" for module in kinds[kind])
            if moe:
                keys.extend(
                    f"{prefix}{EXPERTS_KEY}{linear}._extra_state/shard_{expert}_{total_experts}"
                    for expert in experts
                    for linear in linears
                )
            continue
        if dense:
            keys.extend(
                f"{LAYER_PREFIX}{module}._extra_state/shard_{layer}_{spec.num_layers}"
                for module in kinds[kind]
            )
        if moe:
            keys.extend(
                f"{LAYER_PREFIX}{EXPERTS_KEY}{linear}._extra_state/"
                f"shard_{layer}.{expert}_{spec.num_layers}.{total_experts}"
                for expert in experts
                for linear in linears
            )
    return keys
