"""What the HF reader checks of a checkpoint against its ``config.json``: FP8 weights have the
scales their scheme needs, and nothing is held that the model has no place for."""

from __future__ import annotations

from ckptctl.errors import CheckpointError
from ckptctl.formats.hf.fp8 import FP8, QUANTIZATION, SCALE_SUFFIX, BlockFp8
from ckptctl.formats.safetensors_header import SafetensorsEntry
from ckptctl.io.storage import Storage
from ckptctl.model.hf_layout import CONFIG
from ckptctl.model.layout import ModelSpec
from ckptctl.model.stored import Shape

LM_HEAD = "lm_head.weight"
_INERT = (".rotary_emb.inv_freq",)
"""Buffers older transformers saved that the weights do not depend on (recomputed on load)."""


def scale_problem(
    fp8: BlockFp8 | None,
    name: str,
    shape: Shape,
    scale: tuple[str, SafetensorsEntry | None],
    storage: Storage,
) -> str | None:
    """What keeps FP8 weight ``name`` from being dequantized, if anything."""
    if fp8 is None:
        return (
            f"{storage.describe(CONFIG)}: tensor {name} is {FP8} but there is no "
            f"{QUANTIZATION} to say how it is scaled; cannot read it"
        )
    path, entry = scale
    if entry is None:
        return f"tensor {name} is {FP8} without its scales {name}{SCALE_SUFFIX}"
    expected = fp8.scale_shape(shape)
    if entry.shape != expected or entry.dtype not in ("float32", "bfloat16"):
        return (
            f"{storage.describe(path)}: {name}{SCALE_SUFFIX} is {entry.dtype} "
            f"{list(entry.shape)}; {fp8.describe()} needs float32 {list(expected)}"
        )
    return None


_QWEN_MTP = "mtp."
"""Where Qwen3-Next's and Qwen3.5's hub releases keep their multi-token prediction layer."""


def refuse_unmapped(names: set[str], spec: ModelSpec, storage: Storage) -> None:
    """Refuse a checkpoint holding tensors the model its ``config.json`` describes has no place
    for: a conversion would drop them (an MTP layer the config does not announce, a bias, a
    vision tower). A tied model's ``lm_head.weight`` is skipped as transformers skips it."""
    dropped = sorted(
        n for n in names if not n.endswith(_INERT) and not (spec.tie_embeddings and n == LM_HEAD)
    )
    if dropped:
        shown = ", ".join(dropped[:3]) + (
            f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
        )
        why = "is the config the checkpoint's own?"
        if all(n.startswith(_QWEN_MTP) for n in dropped) and spec.linear_attention is not None:
            why = (
                "Qwen3-Next / Qwen3.5 multi-token prediction weights beyond the "
                "mtp_num_hidden_layers the config announces: is the config the checkpoint's own?"
            )
        raise CheckpointError(
            f"{storage.describe(CONFIG)}: the checkpoint holds {shown}, which the model this "
            f"config.json describes has no place for; a conversion would drop them ({why})"
        )
