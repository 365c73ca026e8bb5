"""Hybrid linear attention (``ckptctl.model.linear_attention``) in Megatron's ``args``, both
ways, in Megatron-LM's own argument names (0.16 and later): ``experimental_attention_variant``
``"gated_delta_net"``, ``linear_attention_freq`` and the ``linear_*`` sizes, and
``attention_output_gate``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model.layout import ModelSpec
from ckptctl.model.linear_attention import (
    SIZE_FIELDS,
    GatedDeltaNetSpec,
    freq_from_pattern,
    pattern_from_freq,
)

VARIANT = "gated_delta_net"


def spec_fields(value: Callable[..., Any], num_layers: int) -> dict[str, Any]:
    """The spec's linear-attention fields from ``args`` (``value(name, default=None)``)."""
    gate = value("attention_output_gate", False)
    if not isinstance(gate, bool):
        raise LayoutError(f"args.attention_output_gate={gate!r} is not true or false")
    out: dict[str, Any] = {"attention_output_gate": gate}
    variant = value("experimental_attention_variant")
    if variant is None:
        return out
    if variant != VARIANT:
        raise LayoutError(
            f"args.experimental_attention_variant={variant!r}: only {VARIANT!r} is supported"
        )
    freq = value("linear_attention_freq")
    attention = pattern_from_freq(freq, num_layers)
    if attention is None:
        raise LayoutError(
            f"args.linear_attention_freq={freq!r}: give an int or a 0/1 list of "
            f"{num_layers} entries (1: gated delta net layer)"
        )
    sizes = {}
    for field, (name, default) in SIZE_FIELDS.items():
        size = value(name, default)
        if isinstance(size, bool) or not isinstance(size, int):
            raise LayoutError(f"args.{name}={size!r} is not an integer")
        sizes[field] = size
    out["linear_attention"] = GatedDeltaNetSpec(**sizes, attention_layers=attention)
    return out


def args_fields(spec: ModelSpec) -> dict[str, Any]:
    """The ``args`` fields that say ``spec``'s linear attention and output gate."""
    out: dict[str, Any] = {"attention_output_gate": spec.attention_output_gate}
    gdn = spec.linear_attention
    if gdn is None:
        return out
    out["experimental_attention_variant"] = VARIANT
    out["linear_attention_freq"] = freq_from_pattern(spec)
    for field, (name, _) in SIZE_FIELDS.items():
        out[name] = getattr(gdn, field)
    return out
