"""Multi-latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight, GLM-4.5's kin): the part of the
model description that says how queries, keys and values are compressed, and how RoPE is
applied to the part of each head that carries position. Pure.

In Megatron-Core's vocabulary (``MLATransformerConfig``): queries go through a down projection
to ``q_lora_rank`` (none: one projection), a norm and an up projection to every head's
``qk_head_dim + qk_pos_emb_head_dim``; keys and values share one down projection to
``kv_lora_rank`` plus the shared positional key (``qk_pos_emb_head_dim``), a norm, and an up
projection to every head's ``qk_head_dim + v_head_dim``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, model_validator

from ckptctl.errors import LayoutError
from ckptctl.model.geometry import Shape, Split

if TYPE_CHECKING:
    from ckptctl.model.layout import ModelSpec


class RopeType(StrEnum):
    ROPE = "rope"
    """Plain RoPE at ``rotary_base``."""
    YARN = "yarn"
    """YaRN: RoPE stretched by ``scaling_factor`` past ``original_max_position_embeddings``,
    with attention scaled by its ``mscale`` terms (DeepSeek-V3's long-context setting)."""


class MlaSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    q_lora_rank: StrictInt | None
    """Rank of the query compression; ``None``: queries are one projection (``linear_q_proj``)."""
    kv_lora_rank: StrictInt
    qk_head_dim: StrictInt
    """A head's query/key dimensions without position (HF ``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: StrictInt
    """A head's query/key dimensions RoPE rotates (HF ``qk_rope_head_dim``)."""
    v_head_dim: StrictInt
    rope_type: RopeType = RopeType.ROPE
    scaling_factor: StrictFloat = 1.0
    """YaRN's stretch (Megatron ``rotary_scaling_factor``, HF ``rope_scaling.factor``)."""
    original_max_position_embeddings: StrictInt | None = None
    beta_fast: StrictFloat = 32.0
    beta_slow: StrictFloat = 1.0
    mscale: StrictFloat = 1.0
    mscale_all_dim: StrictFloat = 0.0

    @model_validator(mode="after")
    def _check(self) -> MlaSpec:
        problems = [
            f"{name}={getattr(self, name)} must be positive"
            for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
            if getattr(self, name) <= 0
        ]
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            problems.append(f"q_lora_rank={self.q_lora_rank} must be positive (or unset)")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) > 1 << 16:
                problems.append(f"{name}={getattr(self, name)} is implausible (at most 65536)")
        if self.q_lora_rank is not None and self.q_lora_rank > 1 << 20:
            problems.append(f"q_lora_rank={self.q_lora_rank} is implausible")
        if self.rope_type is RopeType.YARN and self.original_max_position_embeddings is None:
            problems.append("rope_type=yarn needs original_max_position_embeddings")
        if problems:
            raise LayoutError(problems)
        return self

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def describe(self) -> str:
        q = f"q rank {self.q_lora_rank}" if self.q_lora_rank else "q uncompressed"
        rope = f"RoPE dims {self.qk_pos_emb_head_dim}"
        if self.rope_type is RopeType.YARN:
            rope += f" (YaRN x{self.scaling_factor:g} from {self.original_max_position_embeddings})"
        return (
            f"multi-latent attention ({q}, kv rank {self.kv_lora_rank}, head dims "
            f"{self.qk_head_dim}+{self.qk_pos_emb_head_dim} / v {self.v_head_dim}, {rope})"
        )


def mla_problems(spec: ModelSpec) -> list[str]:
    """What the rest of ``spec`` must be for multi-latent attention."""
    if spec.mla is None:
        return []
    problems = []
    if spec.num_query_groups != spec.num_attention_heads:
        problems.append(
            f"multi-latent attention has a key/value per head: num_query_groups="
            f"{spec.num_query_groups} must equal num_attention_heads={spec.num_attention_heads}"
        )
    if spec.position_embedding.value != "rope":
        problems.append("multi-latent attention needs rope position embeddings")
    return problems


def mla_attention(spec: ModelSpec, layernorm: bool) -> list[tuple[str, Shape, Split]]:
    """A multi-latent attention layer's attention part in the TE spec's registration order
    (``MLASelfAttention``: the output projection first, then q and kv down / up projections,
    each up projection with its fused norm)."""
    mla = spec.mla
    assert mla is not None
    h, n = spec.hidden_size, spec.num_attention_heads
    rep = Split.REPLICATED
    out: list[tuple[str, Shape, Split]] = [("input_layernorm.weight", (h,), rep)]
    if layernorm:
        out.append(("input_layernorm.bias", (h,), rep))
    out.append(("self_attention.linear_proj.weight", (h, n * mla.v_head_dim), Split.ROW))
    if spec.add_bias_linear:
        out.append(("self_attention.linear_proj.bias", (h,), rep))

    def up(which: str, rank: int, rows: int) -> None:
        prefix = f"self_attention.linear_{which}_up_proj."
        if spec.qk_layernorm:
            out.append((prefix + "layer_norm_weight", (rank,), rep))
            if layernorm:
                out.append((prefix + "layer_norm_bias", (rank,), rep))
        out.append((prefix + "weight", (rows, rank), Split.COLUMN))

    q_rows = n * mla.q_head_dim
    if mla.q_lora_rank is None:
        out.append(("self_attention.linear_q_proj.weight", (q_rows, h), Split.COLUMN))
    else:
        out.append(("self_attention.linear_q_down_proj.weight", (mla.q_lora_rank, h), rep))
        up("q", mla.q_lora_rank, q_rows)
    kv_down = mla.kv_lora_rank + mla.qk_pos_emb_head_dim
    out.append(("self_attention.linear_kv_down_proj.weight", (kv_down, h), rep))
    up("kv", mla.kv_lora_rank, n * (mla.qk_head_dim + mla.v_head_dim))
    return out
