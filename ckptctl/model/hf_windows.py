"""Sliding windows in the HF families' ``config.json``, read and written as transformers' own
classes read them. Pure.

Each family says it its own way (transformers 5's configuration classes):

* ``mistral``, ``mixtral``: ``sliding_window = W`` windows every layer; ``null``: none.
* ``qwen3_moe``: the same, switched on by ``use_sliding_window``.
* ``qwen2``, ``qwen3``: ``use_sliding_window`` with ``sliding_window = W``; ``layer_types``
  names each layer ``sliding_attention`` or ``full_attention``; without it, the layers from
  ``max_window_layers`` on are windowed.
* ``qwen2_moe``: likewise, but its default windows every other layer below
  ``max_window_layers`` (layers 0, 2, 4, ...).
* ``gpt_oss``: ``sliding_window`` on the layers ``layer_types`` names; by default every other
  layer, from layer 0.
* ``gemma3_text``: ``sliding_window`` (4096 when left out) on the layers ``layer_types`` names;
  by default all but every ``sliding_window_pattern``-th (6th) layer.

A window of W keys is megatron-core's ``(W - 1, 0)`` (``ckptctl.model.windows``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckptctl.errors import LayoutError
from ckptctl.model.windows import MOST_LAYERS

if TYPE_CHECKING:
    from ckptctl.model.layout import ModelSpec

EVERY_LAYER = frozenset({"mistral", "mixtral", "qwen3_moe"})
SWITCHED = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
"""Families whose window counts only with ``use_sliding_window`` on."""
BY_LAYER_TYPE = frozenset({"qwen2", "qwen3", "qwen2_moe", "gpt_oss", "gemma3_text"})
GEMMA_WINDOW, GEMMA_PATTERN = 4096, 6
"""Gemma 3's window and pattern where its config leaves them out (transformers' defaults)."""
LAYER_KINDS = ("full_attention", "sliding_attention")
MAX_WINDOW_LAYERS_DEFAULT = 28
"""``max_window_layers`` where a Qwen config leaves it out (transformers' class default)."""


def spec_fields(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """``window_size`` and ``full_attention_layers`` of the model ``config`` describes."""
    layers = config["num_hidden_layers"]
    if not isinstance(layers, int) or layers > MOST_LAYERS:
        return {}  # implausible: the spec says so, before any per-layer list is built
    width = _width(config, family)
    kinds = _layer_kinds(config, family, layers, width)
    if width is None:
        if "sliding_attention" in kinds:
            raise LayoutError(
                f"layer_types names sliding_attention layers but sliding_window is "
                f"{config.get('sliding_window')!r} (use_sliding_window="
                f"{config.get('use_sliding_window')!r}): which window they use is unclear"
            )
        return {}
    full = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    if len(full) == layers:
        return {}  # no layer uses the window
    return {"window_size": (width - 1, 0), "full_attention_layers": full}


def _width(config: Mapping[str, Any], family: str) -> int | None:
    if family in SWITCHED and not config.get("use_sliding_window", False):
        return None
    width = config.get("sliding_window", GEMMA_WINDOW if family == "gemma3_text" else None)
    if width is None or (family == "qwen2_moe" and width == 0):
        return None
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise LayoutError(f"sliding_window={width!r}: not a window of tokens")
    return width


def _layer_kinds(
    config: Mapping[str, Any], family: str, layers: int, width: int | None
) -> list[str]:
    if family not in BY_LAYER_TYPE:
        return ["sliding_attention" if width is not None else "full_attention"] * layers
    kinds = config.get("layer_types")
    if kinds is not None:
        if (
            not isinstance(kinds, list)
            or len(kinds) != layers
            or not all(isinstance(kind, str) and kind in LAYER_KINDS for kind in kinds)
        ):
            raise LayoutError(
                f"layer_types={kinds!r}: not one of {', '.join(LAYER_KINDS)} per layer "
                f"({layers} layers)"
            )
        return list(kinds)
    if family == "gpt_oss":
        return [LAYER_KINDS[width is not None and i % 2 == 0] for i in range(layers)]
    if family == "gemma3_text":  # sliding_window_pattern checked by hf_gemma
        pattern = config.get("sliding_window_pattern", GEMMA_PATTERN)
        return [LAYER_KINDS[bool((i + 1) % pattern)] for i in range(layers)]
    start = config.get("max_window_layers", MAX_WINDOW_LAYERS_DEFAULT)
    if isinstance(start, bool) or not isinstance(start, int):
        raise LayoutError(f"max_window_layers={start!r}: not a layer count")
    if family == "qwen2_moe":
        windowed = [width is not None and i % 2 == 0 and i < start for i in range(layers)]
    else:
        windowed = [width is not None and i >= start for i in range(layers)]
    return [LAYER_KINDS[w] for w in windowed]


def problems(spec: ModelSpec, family: str, cls: str) -> list[str]:
    """What of the spec's window ``family`` cannot say."""
    if spec.window_size is None:
        return []
    left, right = spec.window_size
    if family not in EVERY_LAYER | BY_LAYER_TYPE:
        return [f"{cls} has no sliding-window attention (window_size={spec.window_size})"]
    out = []
    if right != 0 or left < 0:
        out.append(
            f"window_size={spec.window_size}: {cls}'s sliding window looks back only, over a "
            "bounded number of tokens"
        )
    if family in EVERY_LAYER and spec.full_attention_layers:
        out.append(
            f"{cls} windows every layer; layers {list(spec.full_attention_layers)} of this "
            "model attend fully"
        )
    return out


def config_fields(spec: ModelSpec, family: str, keys: frozenset[str]) -> dict[str, Any]:
    """The window keys of ``family``'s ``config.json`` for ``spec`` (checked by
    ``problems``); ``keys``: the family's keys, so only those it has are written."""
    out: dict[str, Any] = {}
    if spec.window_size is None:
        if "sliding_window" in keys:
            out["sliding_window"] = None
        if "use_sliding_window" in keys:
            out["use_sliding_window"] = False
        return out
    out["sliding_window"] = spec.window_size[0] + 1
    if family in SWITCHED:
        out["use_sliding_window"] = True
    if family in BY_LAYER_TYPE:
        full = set(spec.full_attention_layers)
        kinds = [LAYER_KINDS[i not in full] for i in range(spec.num_layers)]
        out["layer_types"] = kinds
        if "max_window_layers" in keys:
            out["max_window_layers"] = kinds.index("sliding_attention")
    return out
