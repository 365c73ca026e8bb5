"""HF checkpoints released in FP8 with block scales (DeepSeek-V3/R1, Kimi K2, GLM-4.5-FP8):
``quantization_config`` ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128,
128]}``, each quantized linear weight stored as ``float8_e4m3fn`` beside ``<name>_scale_inv``
(float32, one per block; the last blocks of a dimension may be partial).

They are read dequantized as DeepSeek's own ``weight_dequant`` and transformers' ``Fp8Dequantize``
do: each element widened to float32, multiplied by its block's scale in float32, rounded to
bfloat16. What else a quantization config may say (another method, static activation scales)
is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import ceil
from typing import Any

import numpy as np

from ckptctl.arrays import from_torch, to_torch
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
            [*problems, "ckptctl dequantizes block-scaled FP8 (e4m3, dynamic activations) only"]
        )
    return BlockFp8((block[0], block[1]))


def dequantize(
    weight: np.ndarray, scales: np.ndarray, block: tuple[int, int], first: tuple[int, int]
) -> np.ndarray:
    """Box ``weight`` (float8_e4m3fn, its first element at ``first`` of the whole tensor) times
    its blocks' ``scales`` (the rows and columns of the scale grid the box touches), in float32,
    rounded to bfloat16."""
    import torch

    rows, columns = weight.shape
    row_block = (np.arange(first[0], first[0] + rows) // block[0]) - first[0] // block[0]
    col_block = (np.arange(first[1], first[1] + columns) // block[1]) - first[1] // block[1]
    scale = to_torch(scales).to(torch.float32)
    per_element = scale[torch.from_numpy(row_block)][:, torch.from_numpy(col_block)]
    values = to_torch(weight).to(torch.float32) * per_element
    return from_torch(values.to(torch.bfloat16))


def scale_rows_and_columns(
    block: tuple[int, int], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The box of the scale grid a weight box ``(offsets, sizes)`` needs."""
    first = (offsets[0] // block[0], offsets[1] // block[1])
    last = ((offsets[0] + sizes[0] - 1) // block[0], (offsets[1] + sizes[1] - 1) // block[1])
    return first, (last[0] - first[0] + 1, last[1] - first[1] + 1)


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


def quantize_rows(rows: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, float]:
    """Quantize ``rows`` (at most one block of rows of a weight, any float dtype) as
    transformers' ``Fp8Quantize`` does: per block, scale = 448 / (its largest magnitude, or
    1 for an all-zero block), elements times scale clipped to +-448 and cast to e4m3;
    ``weight_scale_inv`` = 1 / scale. Returns the FP8 rows, their scales' row and the largest
    error of what a reader dequantizes (``dequantize``) against ``rows``."""
    import torch

    x = to_torch(rows).to(torch.float32)
    count, columns = x.shape
    blocks = ceil(columns / block[1])
    padded = torch.nn.functional.pad(x, (0, blocks * block[1] - columns))
    largest = padded.reshape(count, blocks, block[1]).abs().amax(dim=(0, 2))
    safe = torch.where(largest > 0, largest, torch.ones_like(largest))
    scale = torch.where(largest > 0, FP8_MAX / safe, torch.ones_like(safe))
    inverse = (1.0 / scale).to(torch.float32)
    per_column = scale.repeat_interleave(block[1])[:columns]
    q = torch.clamp(x * per_column, min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    codes = from_torch(q)
    back = to_torch(dequantize(codes, from_torch(inverse.reshape(1, -1)), block, (0, 0)))
    error = float((back.to(torch.float32) - x).abs().max()) if x.numel() else 0.0
    return codes, from_torch(inverse), error
