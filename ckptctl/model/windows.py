"""Sliding-window attention in a model description: which layers attend to a window of recent
tokens and how wide it is, in megatron-core's terms, with the translations to and from
Megatron-LM's ``args``. Pure.

megatron-core keeps ``window_size = (left, right)``: a query at position i attends to keys
i - left .. i + right (-1: unbounded), and ``window_attn_skip_freq`` says which layers are
exempt: an int N exempts every N-th layer (1-based numbers divisible by N), a 0/1 list says it
per layer (1: windowed). transformers' ``sliding_window = W`` attends to the last W keys, the
query's own included: ``(W - 1, 0)`` (Megatron-Bridge maps it so too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptctl.errors import LayoutError

if TYPE_CHECKING:
    from ckptctl.model.layout import ModelSpec

MOST_TOKENS = 1 << 30
"""Largest window a description may hold (as ``max_position_embeddings``)."""
MOST_LAYERS = 1 << 12
"""``layout.PLAUSIBLE["num_layers"]``: past it no per-layer pattern is built (the description
is refused as implausible when the spec is made)."""


def window_problems(spec: ModelSpec) -> list[str]:
    """What makes the window fields of ``spec`` inconsistent."""
    window, full = spec.window_size, spec.full_attention_layers
    if window is None:
        return ["full_attention_layers is set but window_size is not"] if full else []
    problems = []
    left, right = window
    if not (-1 <= left <= MOST_TOKENS and -1 <= right <= MOST_TOKENS):
        problems.append(f"window_size={window}: each side must lie in -1..{MOST_TOKENS}")
    if left == -1 and right == -1:
        problems.append("window_size=(-1, -1) is no window: leave window_size unset")
    wrong = [layer for layer in full if not 0 <= layer < spec.num_layers]
    if wrong:
        problems.append(f"full_attention_layers {wrong} are not layers of {spec.num_layers}")
    if len(set(full)) != len(full) or list(full) != sorted(full):
        problems.append(f"full_attention_layers {list(full)} must be distinct and ascending")
    if full and len(full) == spec.num_layers:
        problems.append("every layer is exempt from the window: leave window_size unset")
    return problems


def windowed_layers(spec: ModelSpec) -> tuple[int, ...]:
    """The layers (0-based) that attend through the window."""
    if spec.window_size is None:
        return ()
    full = set(spec.full_attention_layers)
    return tuple(i for i in range(spec.num_layers) if i not in full)


def describe(spec: ModelSpec) -> str:
    """How ``inspect`` says it: ``sliding window 4096 on 3 of 4 layers (full: 3)``."""
    assert spec.window_size is not None
    left, right = spec.window_size
    width = "unbounded" if left == -1 else f"{left + 1}"
    ahead = f", {right} ahead" if right else ""
    full = spec.full_attention_layers
    where = (
        "every layer"
        if not full
        else f"{spec.num_layers - len(full)} of {spec.num_layers} layers (full: {_ranges(full)})"
    )
    return f"sliding window {width}{ahead} on {where}"


def _ranges(layers: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in layers[:8])
    return shown + (f" and {len(layers) - 8} more" if len(layers) > 8 else "")


# --------------------------------------------------------------------------- Megatron args


def from_megatron(
    window: Any, skip_freq: Any, num_layers: int, name: str = "args"
) -> dict[str, Any]:
    """The spec's window fields from megatron-core's ``window_size`` and
    ``window_attn_skip_freq`` (``args`` or a ``TransformerConfig``), as megatron-core's
    ``is_layer_window_attention`` reads them; anything it would not read is refused."""
    if window is None or (isinstance(window, Sequence) and not window):
        return {}
    if not isinstance(num_layers, int) or num_layers > MOST_LAYERS:
        return {}  # implausible: the spec says so
    if (
        not isinstance(window, Sequence)
        or isinstance(window, str)
        or len(window) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in window)
    ):
        raise LayoutError(f"{name}.window_size={window!r}: not a (left, right) window")
    if tuple(window) == (-1, -1):
        return {}  # megatron-core's "infinite window": plain causal attention
    full = _full_layers(skip_freq, num_layers, name)
    if len(full) == num_layers:
        return {}  # every layer exempt: the window is never used
    return {"window_size": (int(window[0]), int(window[1])), "full_attention_layers": full}


def _full_layers(freq: Any, num_layers: int, name: str) -> tuple[int, ...]:
    if freq is None:
        return ()
    if isinstance(freq, str) and freq.strip().isdigit():
        freq = int(freq)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return tuple(i for i in range(num_layers) if (i + 1) % freq == 0)
    if (
        isinstance(freq, Sequence)
        and not isinstance(freq, str)
        and len(freq) == num_layers
        and all(isinstance(v, int) and v in (0, 1) for v in freq)
    ):
        return tuple(i for i, windowed in enumerate(freq) if not windowed)
    raise LayoutError(
        f"{name}.window_attn_skip_freq={freq!r}: not a layer frequency or a 0/1 pattern of "
        f"{num_layers} layers"
    )


def megatron_fields(spec: ModelSpec) -> dict[str, Any]:
    """``window_size`` and ``window_attn_skip_freq`` as Megatron-LM stores them for ``spec``:
    a tuple, and a per-layer 0/1 list where some layers are exempt."""
    if spec.window_size is None:
        return {"window_size": None, "window_attn_skip_freq": None}
    full = set(spec.full_attention_layers)
    pattern = [0 if i in full else 1 for i in range(spec.num_layers)] if full else None
    return {"window_size": tuple(spec.window_size), "window_attn_skip_freq": pattern}
