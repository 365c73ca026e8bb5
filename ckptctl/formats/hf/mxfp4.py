"""GPT-OSS's experts as OpenAI releases them, in MXFP4: ``quantization_config`` ``{"quant_method":
"mxfp4", "modules_to_not_convert": [...]}``; each packed expert weight ``X`` that transformers
holds as ``[experts, in, out]`` is stored as ``X_blocks`` (uint8 ``[experts, out, in / 32, 16]``:
32 FP4 (E2M1) codes a block, two a byte, the low nibble first) and ``X_scales`` (uint8
``[experts, out, in / 32]``: one power of two a block, biased by 127).

They are read dequantized as transformers' ``Mxfp4Dequantize`` does (``mxfp4_math``): each code
looked up as bfloat16, scaled by its block's power of two, the result bfloat16 and transposed
to the in-memory ``[experts, in, out]``. Other quantization settings are refused by name. This
module is the scheme's rules, without numpy or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.errors import CheckpointError

METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32
"""Elements one scale covers."""
DEQUANTIZED = "bfloat16"
_KNOWN = frozenset({"quant_method", "modules_to_not_convert"})


def is_mxfp4(config: Mapping[str, Any]) -> bool:
    quant = config.get("quantization_config")
    return isinstance(quant, Mapping) and quant.get("quant_method") == METHOD


def check_config(config: Mapping[str, Any], where: str) -> None:
    """Refuse, by name, what an MXFP4 ``quantization_config`` says beyond what is read."""
    quant = config["quantization_config"]
    unknown = sorted(set(quant) - _KNOWN)
    if unknown:
        raise CheckpointError(
            f"{where}: quantization_config.{unknown[0]}={quant[unknown[0]]!r}: unknown to "
            "ckptctl, which dequantizes MXFP4 experts as transformers does only"
        )


def stored_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Shapes of ``X_blocks`` and ``X_scales`` for an in-memory ``X`` of ``shape``
    ``[experts, in, out]``; ``None`` if ``in`` is no whole number of blocks."""
    if len(shape) != 3 or shape[1] % BLOCK:
        return None
    experts, inputs, outputs = shape
    groups = inputs // BLOCK
    return (experts, outputs, groups, BLOCK // 2), (experts, outputs, groups)


def parts_problem(name: str, shape: tuple[int, ...], blocks: Any, scales: Any) -> str | None:
    """What keeps in-memory tensor ``name`` of ``shape`` from being read from its MXFP4
    ``blocks`` and ``scales`` (safetensors entries: ``shape``, ``dtype``; ``scales`` ``None``
    when absent), if anything."""
    blocks_name, scales_name = name + BLOCKS, name + SCALES
    if scales is None:
        return f"tensor {blocks_name} is without its scales {scales_name}"
    wanted = stored_shapes(shape)
    if (
        wanted is None
        or (blocks.shape, scales.shape) != wanted
        or {
            blocks.dtype,
            scales.dtype,
        }
        != {"uint8"}
    ):
        return (
            f"{blocks_name} / {scales_name} are {blocks.dtype} {list(blocks.shape)} / "
            f"{scales.dtype} {list(scales.shape)}; MXFP4 of {list(shape)} is uint8 "
            f"{list(wanted[0]) if wanted else '?'} / {list(wanted[1]) if wanted else '?'}"
        )
    return None


def block_range(offset: int, size: int) -> tuple[int, int]:
    """The blocks (first, count) that hold elements ``[offset, offset + size)`` of ``in``."""
    first = offset // BLOCK
    return first, (offset + size - 1) // BLOCK - first + 1
