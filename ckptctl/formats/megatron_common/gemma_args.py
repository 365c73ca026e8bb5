"""Gemma 3's features in Megatron's ``args``, both ways (``ckptctl.model.gemma_features``).

Megatron-LM's parser says one of them: ``--apply-layernorm-1p`` (norms scaling by ``1 +
weight``; ``--layernorm-zero-centered-gamma`` in 0.19). Its ``--openai-gelu`` is no help: the
megatron-core models of 0.12 and later ignore it (it stays refused at ``True``). The rest only
Megatron-Bridge's ``Gemma3ModelProvider`` says, in a config of its own, not in ``args``: ckptctl
records them in fields of its own (``ckptctl_*``, as it records the true vocabulary, all listed
in ``args_fields.MAPPED``), read back exactly. Megatron-LM cannot build such a model; loading
one there fails on the post-sublayer norms it has no module for, never silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model.layout import Activation, ModelSpec


def spec_fields(value: Callable[..., Any]) -> dict[str, Any]:
    """The spec's Gemma fields from ``args`` (``value(name, default=None)`` reads one)."""
    out: dict[str, Any] = {
        "layernorm_zero_centered_gamma": _flag(value, "apply_layernorm_1p")
        or _flag(value, "layernorm_zero_centered_gamma"),
        "post_sublayer_norms": _flag(value, "ckptctl_post_sublayer_norms"),
        "scaled_embedding": _flag(value, "ckptctl_scaled_embedding"),
    }
    for field in ("softmax_scale", "local_rotary_base"):
        number = value(f"ckptctl_{field}")
        if number is not None and (isinstance(number, bool) or not isinstance(number, int | float)):
            raise LayoutError(f"args.ckptctl_{field}={number!r} is not a number")
        out[field] = None if number is None else float(number)
    return out


_ACTIVATIONS = {"gelu_tanh": False, "geglu_tanh": True}
"""``ckptctl_activation``: GELU's tanh form, plain or gated."""


def activation(value: Callable[..., Any]) -> tuple[bool, Activation] | None:
    """(gated, activation) ``ckptctl_activation`` says, or ``None`` when unset."""
    name = value("ckptctl_activation")
    if name is None:
        return None
    if name not in _ACTIVATIONS:
        raise LayoutError(
            f"args.ckptctl_activation={name!r}: ckptctl writes {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name], Activation.GELU_TANH


def args_fields(spec: ModelSpec) -> dict[str, Any]:
    """The ``args`` fields that say ``spec``'s Gemma features."""
    tanh = spec.activation is Activation.GELU_TANH
    out: dict[str, Any] = {"apply_layernorm_1p": spec.layernorm_zero_centered_gamma}
    optional = {
        "ckptctl_activation": (
            ("geglu_tanh" if spec.gated_linear_unit else "gelu_tanh") if tanh else None
        ),
        "ckptctl_post_sublayer_norms": spec.post_sublayer_norms,
        "ckptctl_scaled_embedding": spec.scaled_embedding,
        "ckptctl_softmax_scale": spec.softmax_scale,
        "ckptctl_local_rotary_base": spec.local_rotary_base,
    }
    # written only where set: a plain model's args stay Megatron-LM's own
    return out | {name: v for name, v in optional.items() if v not in (None, False)}


def _flag(value: Callable[..., Any], name: str) -> bool:
    flag = value(name, False)
    if not isinstance(flag, bool):
        raise LayoutError(f"args.{name}={flag!r} is not true or false")
    return flag
