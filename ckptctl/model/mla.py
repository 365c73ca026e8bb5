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

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, model_validator

from ckptctl.errors import LayoutError


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
