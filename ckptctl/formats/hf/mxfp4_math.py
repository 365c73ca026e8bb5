"""The numbers of MXFP4 (``mxfp4``): dequantizing as transformers' ``Mxfp4Dequantize`` does, so
the result is the same bfloat16 bits, NaN and infinity included. Imported only by the reader
that needs it (numpy, torch)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ckptctl.arrays import from_torch, to_torch
from ckptctl.formats.hf.mxfp4 import BLOCK, block_range

Shape = tuple[int, ...]

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code."""
SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``blocks`` (uint8 ``[..., groups, 16]``) and their ``scales`` (uint8 ``[..., groups]``)
    as bfloat16 ``[..., groups * 32]``: codes looked up as bfloat16 and multiplied by
    ``2 ** (scale - 127)`` (torch's ``ldexp``: the power in float32, the product rounded to
    bfloat16, as transformers computes it)."""
    import torch

    codes = to_torch(np.ascontiguousarray(blocks))
    *outer, groups, pairs = codes.shape
    rows = codes.reshape(-1, pairs)
    values = torch.empty(rows.shape[0], 2 * pairs, dtype=torch.bfloat16)
    table = torch.tensor(E2M1, dtype=torch.bfloat16)
    values[:, 0::2] = table[(rows & 0x0F).to(torch.int64)]
    values[:, 1::2] = table[(rows >> 4).to(torch.int64)]
    exponents = to_torch(np.ascontiguousarray(scales)).to(torch.int32).reshape(-1, 1) - SCALE_BIAS
    torch.ldexp(values, exponents, out=values)
    return from_torch(values.reshape(*outer, groups * 2 * pairs))


def read_in_memory_box(
    read: Callable[[tuple[str, str], Shape, Shape], np.ndarray],
    blocks: tuple[str, str],
    scales: tuple[str, str],
    offsets: Shape,
    sizes: Shape,
) -> np.ndarray:
    """Box ``(offsets, sizes)`` of an in-memory ``[experts, in, out]`` tensor, read (``read``:
    (file, name), offsets, sizes) from its MXFP4 ``blocks`` (``[experts, out, in / 32, 16]``)
    and ``scales``: the experts and outputs asked for, and the blocks that hold the inputs
    asked for, dequantized and transposed."""
    first, count = block_range(offsets[1], sizes[1])
    at, size = (offsets[0], offsets[2], first), (sizes[0], sizes[2], count)
    codes = read(blocks, (*at, 0), (*size, BLOCK // 2))
    powers = read(scales, at, size)
    skip = offsets[1] - first * BLOCK
    values = dequantize(codes, powers)[:, :, skip : skip + sizes[1]]
    return np.ascontiguousarray(values.transpose(0, 2, 1))


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Rows of a weight (``[rows, in]``, any float dtype; ``in`` a multiple of 32) in MXFP4:
    per 32 elements a power-of-two scale, the smallest at or above ``amax / 6`` (so no element
    is clipped: OpenAI's ``downcast_to_mxfp`` with its round-up scale), each element rounded
    to the nearest E2M1 value of its scaled self (ties to the even code). Returns the codes
    (uint8 ``[rows, in / 32, 16]``, low nibble first), the biased scales (uint8
    ``[rows, in / 32]``) and the largest error of what ``dequantize`` reads back."""
    import torch

    x = to_torch(np.ascontiguousarray(rows)).to(torch.float32)
    count, columns = x.shape
    groups = x.reshape(count, columns // 32, 32)
    largest = groups.abs().amax(dim=-1)
    # the smallest power of two >= amax / 6 (0 for an all-zero block: code 0, scale 2^-127)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(min=-127, max=127)
    exponent = torch.where(largest > 0, exponent, torch.full_like(exponent, -127))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1[:8], dtype=torch.float32)
    # nearest of the 8 magnitudes; ties go to the even index (mantissa bit 0)
    distance = (scaled.abs().unsqueeze(-1) - magnitudes).abs()
    best = distance.min(dim=-1, keepdim=True).values
    ties = (distance == best).to(torch.int64)
    index = torch.argmax(ties * (1 + (torch.arange(8) % 2 == 0).to(torch.int64)), dim=-1)
    code = index + 8 * (torch.signbit(scaled) & (index > 0)).to(torch.int64)
    pairs = code.reshape(count, columns // 32, 16, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    biased = (exponent + SCALE_BIAS).to(torch.uint8)
    codes, powers = from_torch(packed), from_torch(biased)
    back = to_torch(dequantize(codes, powers)).to(torch.float32)
    error = float((back - x).abs().max()) if x.numel() else 0.0
    return codes, powers, error
