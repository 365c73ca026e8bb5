"""Hybrid linear attention (Qwen3-Next, Qwen3.5): gated delta net layers between ordinary
(softmax) attention layers, and the output gate of those attention layers. Pure.

In megatron-core's vocabulary (``experimental_attention_variant="gated_delta_net"``,
``GatedDeltaNet``): a fused input projection ``in_proj`` (its input norm fused in) makes
queries and keys (``linear_num_key_heads`` x ``linear_key_head_dim`` each), values and an
output gate z (``linear_num_value_heads`` x ``linear_value_head_dim`` each), then beta and
alpha (one per value head); a depthwise causal ``conv1d`` runs over the q, k and v channels;
``A_log`` and ``dt_bias`` (one per value head) set the decay; ``out_norm`` (over a value head)
and ``out_proj`` close it. ``linear_attention_freq`` says which layers are which: an int N
makes every N-th layer (1-based) an attention layer, a 0/1 list says it per layer (1: linear).

Tensor parallelism cuts every part of ``in_proj`` and ``conv1d`` on its own (a shard is the
rank's q, then its k, v, ...), ``A_log`` / ``dt_bias`` by value head, ``out_proj`` by row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, StrictInt, model_validator

from ckptctl.errors import LayoutError
from ckptctl.model.geometry import Shape, Split

if TYPE_CHECKING:
    from ckptctl.model.layout import ModelSpec

IN_PROJ_PARTS = ("query", "key", "value", "z", "beta", "alpha")
"""The parts of ``in_proj``, as megatron-core's ``torch_dist`` keys name them
(``in_proj.weight.query`` ...)."""
CONV_PARTS = ("query", "key", "value")
"""The parts of ``conv1d``'s channels."""
MOST = 1 << 16
SIZE_FIELDS = {
    "num_key_heads": ("linear_num_key_heads", 16),
    "num_value_heads": ("linear_num_value_heads", 32),
    "key_head_dim": ("linear_key_head_dim", 128),
    "value_head_dim": ("linear_value_head_dim", 128),
    "conv_kernel_dim": ("linear_conv_kernel_dim", 4),
}
"""Spec field -> (its name in Megatron-LM's arguments and in HF's Qwen configs alike, the
default both give it)."""
TP_DRIFTING = (".self_attention.out_norm.weight",)
"""Parameters megatron-core replicates over TP without keeping the copies equal (their
gradients are per rank's heads; ``formats.megatron.tp_replicas``)."""


class GatedDeltaNetSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    num_key_heads: StrictInt
    num_value_heads: StrictInt
    key_head_dim: StrictInt
    value_head_dim: StrictInt
    conv_kernel_dim: StrictInt = 4
    attention_layers: tuple[StrictInt, ...] = ()
    """The layers (0-based) with ordinary attention; every other layer is a gated delta net."""

    @model_validator(mode="after")
    def _check(self) -> GatedDeltaNetSpec:
        problems = []
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
            value = getattr(self, name)
            if not 0 < value <= MOST:
                problems.append(f"linear attention {name}={value} must lie in 1..{MOST}")
        if not 0 < self.conv_kernel_dim <= 64:
            problems.append(f"conv_kernel_dim={self.conv_kernel_dim} must lie in 1..64")
        if self.num_key_heads > 0 and self.num_value_heads % self.num_key_heads:
            problems.append(
                f"num_key_heads={self.num_key_heads} does not divide "
                f"num_value_heads={self.num_value_heads}"
            )
        layers = self.attention_layers
        if list(layers) != sorted(set(layers)) or any(layer < 0 for layer in layers):
            problems.append(f"attention_layers {list(layers)} must be distinct, ascending, >= 0")
        if problems:
            raise LayoutError(problems)
        return self

    @property
    def qk_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def v_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def in_proj_parts(self) -> tuple[int, ...]:
        qk, v, nv = self.qk_dim, self.v_dim, self.num_value_heads
        return (qk, qk, v, v, nv, nv)

    @property
    def conv_parts(self) -> tuple[int, ...]:
        return (self.qk_dim, self.qk_dim, self.v_dim)


def is_linear_layer(spec: ModelSpec, layer: int) -> bool:
    """Whether decoder layer ``layer`` (0-based) is a gated delta net layer."""
    gdn = spec.linear_attention
    return gdn is not None and layer not in gdn.attention_layers


def linear_problems(spec: ModelSpec) -> list[str]:
    """What makes the linear-attention fields of ``spec`` inconsistent or unsupported."""
    problems = []
    if spec.attention_output_gate and spec.mla is not None:
        problems.append("attention_output_gate with multi-latent attention: not supported")
    gdn = spec.linear_attention
    if gdn is None:
        return problems
    wrong = [layer for layer in gdn.attention_layers if layer >= spec.num_layers]
    if wrong:
        problems.append(f"linear attention: attention_layers {wrong} are not layers")
    if len(gdn.attention_layers) >= spec.num_layers:
        problems.append("linear attention on no layer: leave linear_attention unset")
    if spec.mla is not None or spec.normalization.value != "RMSNorm":
        problems.append("gated delta net layers need RMSNorm and no multi-latent attention")
    if spec.mtp_num_layers and is_linear_layer(spec, spec.num_layers - 1):
        problems.append("multi-token prediction after a gated delta net layer: not supported")
    return problems


def pattern_from_freq(freq: object, num_layers: int) -> tuple[int, ...] | None:
    """``attention_layers`` from megatron-core's ``linear_attention_freq`` (``None``: it is
    neither an int nor a 0/1 list of ``num_layers`` entries)."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return tuple(i for i in range(num_layers) if (i + 1) % freq == 0)
    flags = list(freq) if isinstance(freq, list | tuple) else []
    if len(flags) == num_layers and all(v in (0, 1) and not isinstance(v, bool) for v in flags):
        return tuple(i for i, v in enumerate(flags) if v == 0)
    return None


def freq_from_pattern(spec: ModelSpec) -> int | list[int]:
    """``linear_attention_freq`` for ``spec``: the int when the pattern is one, else the list."""
    gdn = spec.linear_attention
    assert gdn is not None
    n = spec.num_layers
    for freq in range(1, n + 1):
        if pattern_from_freq(freq, n) == gdn.attention_layers:
            return freq
    return [0 if i in gdn.attention_layers else 1 for i in range(n)]


def describe(spec: ModelSpec) -> list[str]:
    """What ``inspect`` says of these fields."""
    out = []
    gdn = spec.linear_attention
    if gdn is not None:
        linear = spec.num_layers - len(gdn.attention_layers)
        out.append(
            f"gated delta net on {linear} of {spec.num_layers} layers (key heads "
            f"{gdn.num_key_heads} x {gdn.key_head_dim}, value heads {gdn.num_value_heads} x "
            f"{gdn.value_head_dim}, conv {gdn.conv_kernel_dim}; attention: "
            f"{list(gdn.attention_layers)})"
        )
    if spec.attention_output_gate:
        out.append("gated attention output")
    return out


def gdn_attention(spec: ModelSpec) -> list[tuple[str, Shape, Split]]:
    """A gated delta net layer's attention part in megatron-core's ``named_parameters`` order
    (TE spec: the layer's input norm is ``in_proj``'s; ``GatedDeltaNet``'s own parameters
    ``dt_bias`` and ``A_log`` come before its submodules'). No biases: megatron-core builds
    the module without them whatever ``add_bias_linear`` says."""
    gdn = spec.linear_attention
    assert gdn is not None
    h, nv, rep = spec.hidden_size, gdn.num_value_heads, Split.REPLICATED
    conv = (sum(gdn.conv_parts), 1, gdn.conv_kernel_dim)
    return [
        ("self_attention.dt_bias", (nv,), Split.COLUMN),
        ("self_attention.A_log", (nv,), Split.COLUMN),
        ("self_attention.in_proj.layer_norm_weight", (h,), rep),
        ("self_attention.in_proj.weight", (sum(gdn.in_proj_parts), h), Split.PARTS),
        ("self_attention.conv1d.weight", conv, Split.PARTS),
        ("self_attention.out_norm.weight", (gdn.value_head_dim,), rep),
        ("self_attention.out_proj.weight", (h, gdn.v_dim), Split.ROW),
    ]


PART_NAMES = {
    "self_attention.in_proj.weight": IN_PROJ_PARTS,
    "self_attention.conv1d.weight": CONV_PARTS,
}
"""Layer-relative names of the parameters cut into parts, and their parts' names."""


def parts_of(spec: ModelSpec, suffix: str) -> Shape:
    """The part sizes of layer parameter ``suffix`` (``()``: not cut into parts)."""
    gdn = spec.linear_attention
    if gdn is None or suffix not in PART_NAMES:
        return ()
    return gdn.in_proj_parts if suffix.startswith("self_attention.in_proj.") else gdn.conv_parts
