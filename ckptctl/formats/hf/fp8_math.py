"""The numbers of block-scaled FP8 (``fp8``): dequantizing as DeepSeek's ``weight_dequant`` and
transformers' ``Fp8Dequantize`` do, quantizing as transformers' ``Fp8Quantize`` does. Imported
only by the reader and writer that need it (numpy, torch)."""

from __future__ import annotations

from math import ceil

import numpy as np

from ckptctl.arrays import from_torch, to_torch
from ckptctl.formats.hf.fp8 import FP8_MAX


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
