"""Opt-in lossy storage of float tensors: block-wise int8 (``compress --quantize``).

Each run of ``BLOCK`` elements keeps one float32 scale (its largest magnitude / 127) and one
signed byte per element, as 8-bit optimisers store their moments: a quarter of fp32's bytes
plus 1.6%, and the error of an element is at most half a step of its own block, so a few large
values do not flatten a whole tensor. Adam's second moment (non-negative, spanning many orders
of magnitude) is stored as its square root, which halves the exponent range the bytes must
cover. Decoding is deterministic (the same codes give the same bytes on every machine: the
zip CRC-32s ckptctl writes for the dequantized bytes depend on it).
"""

from __future__ import annotations

import numpy as np

BLOCK = 256
LINEAR, SQRT = "int8", "int8-sqrt"
SCHEME = f"int8 absmax per block of {BLOCK}; exp_avg_sq as its square root"
DTYPES = ("float32", "bfloat16", "float16")
"""Element types quantized; others (integers, float64 counters, float8) stay exact."""


def scale_count(numel: int) -> int:
    return -(-numel // BLOCK)


def to_float32(raw: bytes | memoryview, dtype: str) -> np.ndarray:
    """Little-endian elements of ``dtype`` as float32 (exact for all three)."""
    if dtype == "float32":
        return np.frombuffer(raw, "<f4").astype(np.float32)
    if dtype == "float16":
        return np.frombuffer(raw, "<f2").astype(np.float32)
    halves = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
    return halves.view(np.float32)


def from_float32(values: np.ndarray, dtype: str) -> bytes:
    """``values`` stored as ``dtype``, rounded to nearest even (torch's rounding)."""
    if dtype == "float32":
        return values.astype("<f4").tobytes()
    if dtype == "float16":
        return values.astype("<f2").tobytes()
    bits = values.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # finite values only (checked)
    return rounded.astype("<u2").tobytes()


def quantize(values: np.ndarray, transform: str) -> tuple[np.ndarray, np.ndarray]:
    """``(codes int8, scales float32)`` of float32 ``values`` (finite; non-negative for
    ``SQRT``)."""
    x = np.sqrt(values) if transform == SQRT else values
    n = len(x)
    padded = np.zeros(scale_count(n) * BLOCK, np.float32)
    padded[:n] = x
    blocks = padded.reshape(-1, BLOCK)
    scales = (np.abs(blocks).max(axis=1) / 127).astype(np.float32)
    safe = np.where(scales > 0, scales, 1).astype(np.float32)
    codes = np.clip(np.rint(blocks / safe[:, None]), -127, 127).astype(np.int8)
    return codes.reshape(-1)[:n], scales


def dequantize(codes: np.ndarray, scales: np.ndarray, transform: str) -> np.ndarray:
    """float32 values of ``codes`` (starting on a block boundary; one scale per block)."""
    n = len(codes)
    padded = np.zeros(scale_count(n) * BLOCK, np.float32)
    padded[:n] = codes
    x = (padded.reshape(-1, BLOCK) * scales[: scale_count(n), None]).reshape(-1)[:n]
    return x * x if transform == SQRT else x


def transform_for(name: str) -> str:
    return SQRT if "exp_avg_sq" in name else LINEAR
