"""The decoder features Gemma 3 brings to the model description, checked and said in words. Pure.

Norms that scale by ``1 + weight`` (``layernorm_zero_centered_gamma``), a norm after
attention and after the MLP as well as before them (``post_sublayer_norms``), an embedding
scaled by ``sqrt(hidden_size)`` (``scaled_embedding``), an attention softmax scale of its own
(``softmax_scale``) and a RoPE base of the windowed layers of their own (``local_rotary_base``,
with linear RoPE scaling on the full-attention layers only). None of them changes a stored
weight's numbers; each changes the math, so each is carried, checked and refused by name
where a target cannot say it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptctl.model.rope_scaling import RopeScalingKind

if TYPE_CHECKING:
    from ckptctl.model.layout import ModelSpec


def feature_problems(spec: ModelSpec) -> list[str]:
    """What makes these fields of ``spec`` inconsistent or unsupported together."""
    problems = []
    if spec.post_sublayer_norms and (spec.is_moe or spec.mla is not None):
        problems.append(
            "post_sublayer_norms with routed experts or multi-latent attention: not supported"
        )
    scale = spec.softmax_scale
    if scale is not None and not 0 < scale <= 1e3:
        problems.append(f"softmax_scale={scale} must be a positive scale")
    base = spec.local_rotary_base
    if base is not None:
        if spec.window_size is None:
            problems.append("local_rotary_base needs windowed layers (window_size)")
        if not 1.0 < base <= 1e12:
            problems.append(f"local_rotary_base={base} is not a RoPE base")
    linear = spec.rope_scaling is not None and spec.rope_scaling.kind is RopeScalingKind.LINEAR
    if linear and base is None:
        problems.append(
            "linear RoPE scaling is carried only as Gemma 3 uses it: on the full-attention "
            "layers of a model whose windowed layers have a RoPE base of their own "
            "(local_rotary_base)"
        )
    return problems


def describe_features(spec: ModelSpec) -> list[str]:
    """The features ``spec`` has, for ``inspect``."""
    out = []
    if spec.layernorm_zero_centered_gamma:
        out.append("norms scale by 1 + weight")
    if spec.post_sublayer_norms:
        out.append("norms after attention and MLP too")
    if spec.scaled_embedding:
        out.append("embedding scaled by sqrt(hidden)")
    if spec.softmax_scale is not None:
        out.append(f"softmax scale {spec.softmax_scale:.6g}")
    if spec.local_rotary_base is not None:
        out.append(f"windowed layers' RoPE base {spec.local_rotary_base:g}")
    return out
