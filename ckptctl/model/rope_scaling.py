"""RoPE stretched past the context a model was pretrained at, for models without multi-latent
attention (whose YaRN is ``MlaSpec``'s): Llama 3.1's ``llama3`` scaling and YaRN (GPT-OSS,
Qwen2.5/Qwen3 long-context configs). Pure.

Both sides name the same numbers:

* transformers: ``rope_parameters`` (``rope_scaling`` in older configs) ``{"rope_type":
  "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``
  or ``{"rope_type": "yarn", "factor", "original_max_position_embeddings", "beta_fast",
  "beta_slow", "mscale", "mscale_all_dim", "truncate"}``.
* Megatron-LM: ``--use-rope-scaling --rope-scaling-factor F`` (megatron-core fixes the other
  llama3 numbers at 1, 4 and 8192), or ``--position-embedding-type yarn`` with
  ``--rotary-scaling-factor``, ``--yarn-original-max-position-embeddings``,
  ``--yarn-beta-fast``, ``--yarn-beta-slow``, ``--mscale``, ``--mscale-all-dim`` and
  ``--[no-]yarn-correction-range-round-to-int`` (transformers' ``truncate``).

YaRN's attention scaling differs in one corner: transformers uses ``mscale`` and
``mscale_all_dim`` only when both are set (non-zero), megatron-core always divides one by the
other; a pair only one side can say is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, model_validator

from ckptctl.errors import CheckpointError, LayoutError


class RopeScalingKind(StrEnum):
    LLAMA3 = "llama3"
    YARN = "yarn"
    LINEAR = "linear"
    """Every frequency divided by ``factor`` (Gemma 3's full-attention layers only)."""


MEGATRON_LLAMA3 = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""The llama3 numbers megatron-core's ``RotaryEmbedding`` fixes (Llama 3.1 / 3.2 / 3.3's)."""


class RopeScaling(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: RopeScalingKind
    factor: StrictFloat
    original_max_position_embeddings: StrictInt | None = None
    """The pretraining context (llama3, YaRN); linear scaling has none."""
    low_freq_factor: StrictFloat = 1.0
    """llama3: wavelengths past ``original / low_freq_factor`` are divided by ``factor``."""
    high_freq_factor: StrictFloat = 4.0
    """llama3: wavelengths under ``original / high_freq_factor`` are kept."""
    beta_fast: StrictFloat = 32.0
    beta_slow: StrictFloat = 1.0
    mscale: StrictFloat = 1.0
    mscale_all_dim: StrictFloat = 0.0
    truncate: bool = True
    """YaRN: the correction range rounded to whole dimensions (megatron-core's
    ``yarn_correction_range_round_to_int``)."""

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        problems = []
        if not self.factor > 0:
            problems.append(f"rope scaling factor={self.factor} must be positive")
        original = self.original_max_position_embeddings
        if self.kind is RopeScalingKind.LINEAR:
            if original is not None:
                problems.append("linear RoPE scaling has no original_max_position_embeddings")
        elif original is None or not 0 < original <= 1 << 30:
            problems.append(
                f"original_max_position_embeddings={self.original_max_position_embeddings} "
                "must be a positive context length"
            )
        if self.kind is RopeScalingKind.LLAMA3 and not (
            0 < self.low_freq_factor < self.high_freq_factor
        ):
            problems.append(
                f"low_freq_factor={self.low_freq_factor} must be positive and below "
                f"high_freq_factor={self.high_freq_factor}"
            )
        if problems:
            raise LayoutError(problems)
        return self

    def describe(self) -> str:
        if self.kind is RopeScalingKind.LINEAR:
            return f"linear x{self.factor:g}"
        return f"{self.kind} x{self.factor:g} from {self.original_max_position_embeddings}"


_COMMON = frozenset(
    {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings"}
)
_KEYS = {
    RopeScalingKind.LLAMA3: _COMMON | {"low_freq_factor", "high_freq_factor"},
    RopeScalingKind.YARN: _COMMON
    | {"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}


def hf_parameters_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s RoPE parameters: ``rope_parameters``, with an older config's
    ``rope_scaling`` read over them, as transformers reads them."""
    parts = []
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key) or {}
        if not isinstance(value, Mapping):
            raise CheckpointError(f"config.json: {key}={value!r} is not an object")
        parts.append(value)
    return {**parts[0], **parts[1]}


def from_hf(parameters: Any, max_position_embeddings: int) -> RopeScaling | None:
    """The scaling an HF ``rope_parameters`` / ``rope_scaling`` object says, as transformers
    computes it; ``None`` for plain RoPE; anything else refused by name."""
    if not parameters:
        return None
    if not isinstance(parameters, Mapping):
        raise LayoutError(f"rope_parameters={parameters!r} is not an object")
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if not isinstance(kind, str):
        raise LayoutError(f"rope_parameters.rope_type={kind!r} is not a name")
    if kind == "default":
        extra = sorted(set(parameters) - {"rope_type", "type", "rope_theta"})
        if extra:
            raise LayoutError(f"rope_parameters.{extra[0]}: unknown to ckptctl for plain RoPE")
        return None
    if kind not in _KEYS:
        raise LayoutError(
            f"rope_parameters.rope_type={kind!r}: ckptctl reads llama3 and yarn RoPE scaling"
        )
    kind = RopeScalingKind(kind)
    unknown = sorted(set(parameters) - _KEYS[kind])
    if unknown:
        raise LayoutError(
            f"rope_parameters.{unknown[0]}={parameters[unknown[0]]!r}: unknown to ckptctl "
            f"for {kind} RoPE scaling"
        )
    original = parameters.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool):
        raise LayoutError(
            f"rope_parameters.original_max_position_embeddings={original!r}: {kind} RoPE "
            "scaling needs the pretraining context"
        )
    factor = parameters.get("factor")
    if factor is None and kind is RopeScalingKind.YARN:
        factor = max_position_embeddings / original  # transformers' reading of no factor
    fields: dict[str, Any] = {
        "kind": kind,
        "factor": _number(factor, "factor"),
        "original_max_position_embeddings": original,
    }
    if kind is RopeScalingKind.LLAMA3:
        for name in ("low_freq_factor", "high_freq_factor"):
            fields[name] = _number(parameters.get(name), name)
        return RopeScaling(**fields)
    for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        fields[name] = _number(parameters.get(name, default), name)
    mscale, all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if mscale and all_dim:  # transformers uses the two only together
        fields["mscale"] = _number(mscale, "mscale")
        fields["mscale_all_dim"] = _number(all_dim, "mscale_all_dim")
    truncate = parameters.get("truncate", True)
    if not isinstance(truncate, bool):
        raise LayoutError(f"rope_parameters.truncate={truncate!r} is not true or false")
    return RopeScaling(**fields, truncate=truncate)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LayoutError(f"rope_parameters.{name}={value!r} is not a number")
    return float(value)


def hf_parameters(scaling: RopeScaling, base: float) -> dict[str, Any]:
    """``rope_parameters`` as transformers 5 saves them."""
    if scaling.kind is RopeScalingKind.LINEAR:
        return {"rope_type": "linear", "rope_theta": base, "factor": scaling.factor}
    out: dict[str, Any] = {
        "rope_type": scaling.kind.value,
        "rope_theta": base,
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }
    if scaling.kind is RopeScalingKind.LLAMA3:
        out |= {
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
        }
        return out
    # transformers' defaults left out, as its own configs leave them
    if scaling.beta_fast != 32.0:
        out["beta_fast"] = scaling.beta_fast
    if scaling.beta_slow != 1.0:
        out["beta_slow"] = scaling.beta_slow
    if scaling.mscale_all_dim:
        out |= {"mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim}
    if not scaling.truncate:
        out["truncate"] = False
    return out


def hf_problems(scaling: RopeScaling, cls: str) -> list[str]:
    """What of a YaRN scaling transformers cannot say."""
    if scaling.kind is not RopeScalingKind.YARN:
        return []
    plain = scaling.mscale == 1.0 and scaling.mscale_all_dim == 0.0
    if plain or (scaling.mscale and scaling.mscale_all_dim):
        return []
    return [
        f"YaRN mscale={scaling.mscale:g}, mscale_all_dim={scaling.mscale_all_dim:g}: {cls}'s "
        "YaRN uses the two only together (both set) or neither"
    ]


# --------------------------------------------------------------------------- Megatron args


def from_megatron(value: Callable[[str, Any], Any], position_type: str) -> RopeScaling | None:
    """The scaling Megatron-LM's ``args`` say (``value(name, default)`` reads one), for a
    model without multi-latent attention."""
    llama3 = bool(value("use_rope_scaling", False))
    if llama3 and position_type == "yarn":
        raise LayoutError(
            "args.use_rope_scaling with position_embedding_type='yarn': two RoPE scalings"
        )

    def number(name: str, default: float) -> float:
        got = value(name, default)
        if isinstance(got, bool) or not isinstance(got, int | float):
            raise LayoutError(f"args.{name}={got!r} is not a number")
        return float(got)

    linear = value("ckptctl_rope_linear_factor", None)
    if linear is not None:
        if llama3 or position_type == "yarn":
            raise LayoutError("args.ckptctl_rope_linear_factor with another RoPE scaling")
        factor = number("ckptctl_rope_linear_factor", 1.0)
        return RopeScaling(kind=RopeScalingKind.LINEAR, factor=factor)
    if llama3:
        return RopeScaling(
            kind=RopeScalingKind.LLAMA3,
            factor=number("rope_scaling_factor", 8.0),
            **MEGATRON_LLAMA3,  # type: ignore[arg-type]
        )
    if position_type != "yarn":
        return None
    truncate = value("yarn_correction_range_round_to_int", None)
    return RopeScaling(
        kind=RopeScalingKind.YARN,
        factor=number("rotary_scaling_factor", 1.0),
        original_max_position_embeddings=int(number("yarn_original_max_position_embeddings", 4096)),
        beta_fast=number("yarn_beta_fast", 32.0),
        beta_slow=number("yarn_beta_slow", 1.0),
        mscale=number("mscale", 1.0),
        mscale_all_dim=number("mscale_all_dim", 0.0),
        truncate=True if truncate is None else bool(truncate),
    )


def position_type(scaling: RopeScaling | None, plain: str) -> str:
    """Megatron-LM's ``position_embedding_type``: ``"yarn"`` for YaRN, else ``plain``."""
    return "yarn" if scaling is not None and scaling.kind is RopeScalingKind.YARN else plain


def megatron_args(scaling: RopeScaling | None) -> dict[str, Any]:
    """The ``args`` fields that say ``scaling`` (YaRN's ``position_embedding_type`` aside:
    ``"yarn"``, see ``position_type``)."""
    if scaling is None:
        return {}
    if scaling.kind is RopeScalingKind.LINEAR:
        # megatron-core's own linear scaling divides positions, not frequencies (the same
        # numbers only up to rounding): ckptctl's own field keeps the exact one
        return {"ckptctl_rope_linear_factor": scaling.factor}
    if scaling.kind is RopeScalingKind.LLAMA3:
        fixed = {name: getattr(scaling, name) for name in MEGATRON_LLAMA3}
        if fixed != MEGATRON_LLAMA3:
            raise LayoutError(
                f"llama3 RoPE scaling with {fixed}: megatron-core fixes "
                f"{MEGATRON_LLAMA3} (keep the model in HF)"
            )
        return {"use_rope_scaling": True, "rope_scaling_factor": scaling.factor}
    return {
        "rotary_scaling_factor": scaling.factor,
        "yarn_original_max_position_embeddings": scaling.original_max_position_embeddings,
        "yarn_beta_fast": scaling.beta_fast,
        "yarn_beta_slow": scaling.beta_slow,
        "mscale": scaling.mscale,
        "mscale_all_dim": scaling.mscale_all_dim,
        "yarn_correction_range_round_to_int": scaling.truncate,
    }
