"""HF checkpoints released in FP8 with block scales (DeepSeek-V3/R1, Kimi K2, GLM-4.5-FP8):
``quantization_config`` ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128,
128]}``, each quantized linear weight stored as ``float8_e4m3fn`` beside ``<name>_scale_inv``
(float32, one per block; the last blocks of a dimension may be partial).

They are read dequantized as DeepSeek's own ``weight_dequant`` and transformers' ``Fp8Dequantize``
do: each element widened to float32, multiplied by its block's scale in float32, rounded to
bfloat16 (``fp8_math``). What else a quantization config may say (another method, static
activation scales) is refused by name. This module is the scheme's rules, without numpy: the
target imports it on every run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import ceil
from typing import Any

from ckptctl.errors import CheckpointError, LayoutError

QUANTIZATION = "quantization_config"
SCALE_SUFFIX = "_scale_inv"
FP8 = "float8_e4m3fn"
DEQUANTIZED = "bfloat16"
"""What a dequantized weight is presented as (DeepSeek's ``fp8_cast_bf16`` writes bf16)."""
_KNOWN = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "modules_to_not_convert"}


@dataclass(frozen=True, slots=True)
class BlockFp8:
    """Weights in float8_e4m3fn, one float32 scale per ``block`` of (rows, columns)."""

    block: tuple[int, int]

    def describe(self) -> str:
        return f"FP8 (e4m3) in {self.block[0]}x{self.block[1]} blocks, read as {DEQUANTIZED}"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        rows, columns = shape
        return ceil(rows / self.block[0]), ceil(columns / self.block[1])


def block_fp8(config: Mapping[str, Any]) -> BlockFp8 | None:
    """The block FP8 scheme ``config.json`` announces, if any; refused by name if it says what
    ckptctl cannot dequantize exactly."""
    quant = config.get(QUANTIZATION)
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise CheckpointError(f"config.json: {QUANTIZATION}={quant!r} is not an object")
    problems = [
        f"{QUANTIZATION}.{key}={quant[key]!r}"
        for key, plain in (
            ("quant_method", "fp8"),
            ("fmt", "e4m3"),
            ("activation_scheme", "dynamic"),
        )
        if key in quant and quant[key] != plain
    ]
    if quant.get("quant_method") is None:
        problems.append(f"{QUANTIZATION} has no quant_method")
    problems += [f"{QUANTIZATION}.{key}: unknown to ckptctl" for key in sorted(set(quant) - _KNOWN)]
    block = quant.get("weight_block_size", [128, 128])
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        problems.append(f"{QUANTIZATION}.weight_block_size={block!r} (two block sizes expected)")
    if problems:
        raise LayoutError(
            [
                *problems,
                "ckptctl dequantizes block-scaled FP8 (e4m3, dynamic activations), and "
                "GPT-OSS's MXFP4 experts, only",
            ]
        )
    return BlockFp8((block[0], block[1]))


# --- writing ---------------------------------------------------------------------------------

WRITE_BLOCK = BlockFp8((128, 128))
"""The blocks ``--dtype fp8-block`` writes: DeepSeek-V3's."""
FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value: each block is scaled so its largest magnitude is it."""


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether HF tensor ``name`` is stored in FP8 under ``--dtype fp8-block``: as DeepSeek's
    release does, every linear weight of attention and MLP (experts included), but the router,
    norms, embeddings, the output layer and the MTP layers' own projection stay as they are."""
    return (
        len(shape) == 2
        and (".self_attn." in name or ".mlp." in name)
        and not name.endswith(".mlp.gate.weight")
    )


def quantization_config(fp8: BlockFp8) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for weights written as ``fp8``."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(fp8.block),
    }
