"""Megatron-LM's multi-latent attention arguments and ckptctl's ``MlaSpec``, both ways.

Megatron-LM builds an ``MLATransformerConfig`` from the arguments whose names match its fields:
the five sizes, ``rotary_scaling_factor``, ``mscale`` and ``mscale_all_dim`` come from
``args``; ``rope_type`` too when set (``--rope-type``), else the config's default, YaRN; YaRN's
``original_max_position_embeddings``, ``beta_fast`` and ``beta_slow`` have no argument of their
name and keep the config's defaults (4096, 32, 1: the ``yarn_*`` arguments are read only by
non-MLA models). So a run with Megatron-LM's defaults applies YaRN with a stretch of 1, which
computes what plain RoPE computes; it is carried as it is.
"""

from __future__ import annotations

import argparse
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model.mla import MlaSpec, RopeType

MLA_MAPPED = frozenset(
    """multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim
    v_head_dim rotary_scaling_factor mscale mscale_all_dim rope_type""".split()  # noqa: SIM905
)
"""Read into ``MlaSpec`` while ``multi_latent_attention`` is on."""
MLA_HARMLESS = frozenset({"cache_mla_latents"})
"""Inference-time caching of the compressed latents: the weights mean the same."""
MLA_PLAIN_VALUES: dict[str, tuple[object, ...]] = {"mla_down_proj_fusion": (False,)}
"""``--mla-down-proj-fusion`` stores the q and kv down projections as one tensor."""

ORIGINAL_MAX_POSITIONS = 4096
CONFIG_DEFAULTS = {
    "original_max_position_embeddings": ORIGINAL_MAX_POSITIONS,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
"""``MLATransformerConfig``'s YaRN fields that no Megatron-LM argument sets (``MlaSpec``'s
``beta_fast`` / ``beta_slow`` defaults are these)."""


def _value(args: argparse.Namespace, name: str, default: Any) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def mla_spec(args: argparse.Namespace) -> MlaSpec | None:
    """The multi-latent attention of a Megatron-LM run, with its config's defaults."""
    if not getattr(args, "multi_latent_attention", False):
        return None
    rope = _value(args, "rope_type", RopeType.YARN.value)
    if rope not in {r.value for r in RopeType}:
        raise LayoutError(f"args.rope_type={rope!r}: not supported yet")
    return MlaSpec(
        q_lora_rank=getattr(args, "q_lora_rank", None),
        kv_lora_rank=_value(args, "kv_lora_rank", 32),
        qk_head_dim=_value(args, "qk_head_dim", 128),
        qk_pos_emb_head_dim=_value(args, "qk_pos_emb_head_dim", 64),
        v_head_dim=_value(args, "v_head_dim", 128),
        rope_type=RopeType(rope),
        scaling_factor=float(_value(args, "rotary_scaling_factor", 1.0)),
        mscale=float(_value(args, "mscale", 1.0)),
        mscale_all_dim=float(_value(args, "mscale_all_dim", 0.0)),
        original_max_position_embeddings=(
            ORIGINAL_MAX_POSITIONS if rope == RopeType.YARN.value else None
        ),
    )


def mla_args(mla: MlaSpec | None) -> dict[str, Any]:
    """Megatron-LM arguments that build ``mla`` (refused where no argument can say it)."""
    if mla is None:
        return {"multi_latent_attention": False}
    if mla.rope_type is RopeType.YARN:
        differs = [
            f"{name}={getattr(mla, name)}"
            for name, default in CONFIG_DEFAULTS.items()
            if getattr(mla, name) != default
        ]
        if differs:
            raise LayoutError(
                f"YaRN with {', '.join(differs)}: Megatron-LM's arguments cannot set it for "
                "multi-latent attention (its config keeps "
                + ", ".join(f"{k}={v}" for k, v in CONFIG_DEFAULTS.items())
                + ")"
            )
    return {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_head_dim,
        "qk_pos_emb_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_type": mla.rope_type.value,
        "rotary_scaling_factor": mla.scaling_factor,
        "mscale": mla.mscale,
        "mscale_all_dim": mla.mscale_all_dim,
        "cache_mla_latents": False,
        "mla_down_proj_fusion": False,
    }
