"""Lossless chunk codec for checkpoint bytes: optional XOR against the same bytes of a base
checkpoint, byte-plane shuffling, then zstd.

Consecutive checkpoints of one run differ little: XOR of two nearby floats leaves the sign,
exponent and high mantissa bits zero. Shuffling the bytes of each element into planes (all
first bytes, then all second bytes, ...) puts those zeros side by side, where zstd compresses
them to almost nothing; the low mantissa bytes stay noise. Without a base the shuffle still
helps (exponent bytes of one tensor repeat). The element width (1, 2, 4 or 8 bytes) is chosen
per chunk by trying each on a sample, since a chunk of a file holds one dtype or a few.

A chunk is written as ``mode`` + payload: ``mode`` is ``r`` (stored raw: it did not compress),
or ``[x]<width>`` (``x``: XOR-ed with the base).
"""

from __future__ import annotations

import numpy as np
import zstandard

CHUNK_SIZE = 4 << 20
"""Uncompressed bytes per chunk: a ranged read decodes at most one extra chunk at each end."""
LEVEL = 3
WIDTHS = (1, 2, 4, 8)
_SAMPLE = 256 << 10


def shuffle(data: np.ndarray, width: int) -> np.ndarray:
    """Byte planes of ``width``-byte elements (the tail that fills no element stays last)."""
    n = len(data) // width * width
    if width == 1 or n == 0:
        return data
    planes = data[:n].reshape(-1, width).T.reshape(-1)
    return np.concatenate([planes, data[n:]])


def unshuffle(data: np.ndarray, width: int) -> np.ndarray:
    n = len(data) // width * width
    if width == 1 or n == 0:
        return data
    elements = data[:n].reshape(width, -1).T.reshape(-1)
    return np.concatenate([elements, data[n:]])


def _aligned(base: bytes | memoryview, size: int) -> np.ndarray:
    """The base's bytes at the chunk's position, zero past the base's end (XOR with zero keeps
    the byte)."""
    out = np.zeros(size, np.uint8)
    got = np.frombuffer(base, np.uint8)[:size]
    out[: len(got)] = got
    return out


def _best_width(data: np.ndarray) -> int:
    sample = data[:_SAMPLE]
    fast = zstandard.ZstdCompressor(level=1)
    sizes = {w: len(fast.compress(shuffle(sample, w).tobytes())) for w in WIDTHS}
    return min(WIDTHS, key=lambda w: (sizes[w], w))


def encode(chunk: bytes | memoryview, base: bytes | memoryview | None) -> tuple[str, bytes]:
    """``(mode, payload)`` of one chunk (``base``: the base checkpoint's bytes at the same
    position of the same file, or None)."""
    data = np.frombuffer(chunk, np.uint8)
    delta = base is not None
    if delta:
        data = data ^ _aligned(base, len(data))  # type: ignore[arg-type]
    width = _best_width(data)
    payload = zstandard.ZstdCompressor(level=LEVEL).compress(shuffle(data, width).tobytes())
    if len(payload) >= len(chunk) and not delta:
        return "r", bytes(chunk)
    return f"{'x' if delta else ''}{width}", payload


def decode(mode: str, payload: bytes, size: int, base: bytes | memoryview | None) -> bytes:
    """The chunk's original ``size`` bytes."""
    if mode == "r":
        return payload
    delta = mode.startswith("x")
    width = int(mode.removeprefix("x"))
    raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
    data = unshuffle(np.frombuffer(raw, np.uint8), width)
    if delta:
        if base is None:
            raise ValueError("chunk was encoded against a base that is not given")
        data = data ^ _aligned(base, size)
    if len(data) != size:
        raise ValueError(f"chunk decodes to {len(data)} bytes, not {size}")
    return data.tobytes()
