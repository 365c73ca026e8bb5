"""Where ``compress --quantize`` may lose precision, and how the files stay valid when it does.

Regions are the float tensors the source's own format reader locates in its files (model
weights; with ``all``, optimizer state and fp32 masters too), each a contiguous byte range.
The stored stream of a file is the original with those ranges zeroed (their int8 codes live
beside it) and every zip CRC-32 that covers them replaced by the CRC of the dequantized bytes,
so ``torch.load`` and ckptctl's readers accept the decoded file as they accepted the original.
The dequantized bytes are a deterministic function of the source's (``quantize``), so they are
computed again wherever needed instead of being held in memory.
"""

from __future__ import annotations

import collections
import struct
import zipfile
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ckptctl.checksums.crc import crc32
from ckptctl.compression import quantize as q
from ckptctl.errors import UsageError
from ckptctl.io.storage import Storage
from ckptctl.model.dtypes import ITEMSIZE

MIN_NUMEL = 4096
"""Smaller tensors (norms, biases, counters) stay exact: a few bytes saved, not worth an error."""
SCOPES = ("weights", "all")
_OPTIMIZER_KEYS = {"optimizer", "optim", "optimizer_state_dict", "base_optimizer_state"}
_STATE_PREFIXES = ("exp_avg", "exp_avg_sq", "fp32_param", "param/", "step/")
STEP = q.BLOCK * 4096
"""Elements per stored piece of a region: its codes, then its scales (whole blocks, so a
ranged read finds any element's piece by arithmetic and memory holds one piece at a time)."""
PIECE = STEP + 4 * (STEP // q.BLOCK)


@dataclass
class Region:
    offset: int
    nbytes: int
    dtype: str
    transform: str
    name: str
    """The canonical tensor (``verify --against`` compares by it)."""
    stored_as: str = ""
    """The tensor's name (key path) in its file."""
    max_abs_error: float = 0.0

    @property
    def numel(self) -> int:
        return self.nbytes // ITEMSIZE[self.dtype]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def is_optimizer_state(canonical: str, key: tuple[Any, ...]) -> bool:
    """Optimizer moments, fp32 masters and counters, by where they sit or what they are
    called (Megatron's ``exp_avg/...`` names, DCP's ``optim.state...``, DeepSpeed's files)."""
    head = str(key[0]).split(".", 1)[0] if key else ""
    in_optimizer = any(str(k) in _OPTIMIZER_KEYS for k in key) or head in _OPTIMIZER_KEYS
    return in_optimizer or canonical.startswith(_STATE_PREFIXES)


def find_regions(ckpt: Any, scope: str) -> dict[str, list[Region]]:
    """The tensors ``scope`` asks for, as byte regions of each file (relative path), sorted
    and not overlapping (a tensor viewed twice is quantized once)."""
    if scope not in SCOPES:
        raise UsageError(f"--quantize {scope}: choose weights or all")
    if not ckpt.locates:
        raise UsageError(
            f"--quantize: ckptctl cannot locate the tensors of {ckpt.storage.url} in its files "
            "(it can for Megatron, DeepSpeed, DCP, torch_dist, HF and torch files)",
            hint="compress it losslessly",
        )
    found: dict[str, list[Region]] = {}
    for file in ckpt.view.files:
        for t in file.tensors:
            if t.dtype not in q.DTYPES or t.numel < MIN_NUMEL or t.transposed or t.base_shape:
                continue
            if scope == "weights" and is_optimizer_state(t.canonical, t.key):
                continue
            view = (t.view_offset, t.shape) if t.view_offset is not None else None
            span = ckpt.where(file.path, t.key, (0,) * len(t.shape), t.shape, view)
            if span is None:
                continue
            transform = q.transform_for(f"{t.canonical} {t.key}")
            found.setdefault(span.rel, []).append(
                Region(
                    span.offset,
                    span.nbytes,
                    t.dtype,
                    transform,
                    t.canonical,
                    ".".join(map(str, t.key)),
                )
            )
    out = {}
    for rel, regions in found.items():
        kept: list[Region] = []
        for r in sorted(regions, key=lambda r: r.offset):
            if not kept or r.offset >= kept[-1].end:
                kept.append(r)
        out[rel] = kept
    return out


def region_values(source: Storage, rel: str, region: Region, first: int, count: int) -> Any:
    """Elements ``[first, first + count)`` of the region, as float32."""
    size = ITEMSIZE[region.dtype]
    raw = source.read_range(rel, region.offset + first * size, count * size)
    return q.to_float32(raw, region.dtype)


def check_region(source: Storage, rel: str, region: Region) -> bool:
    """Whether quantizing the region is sound: no NaN or inf, no negative second moment (a
    region that is not stays exact)."""
    for first in range(0, region.numel, STEP):
        values = region_values(source, rel, region, first, min(STEP, region.numel - first))
        if not np.isfinite(values).all() or (region.transform == q.SQRT and (values < 0).any()):
            return False
    return True


def write_region(source: Storage, rel: str, region: Region, out: Any, pool: Executor) -> None:
    """The region's pieces (each one's int8 codes, then its float32 scales), quantized on
    ``pool`` a few at a time and written in order, recording the largest error they leave."""
    worst = 0.0

    def piece(first: int) -> tuple[bytes, bytes, float]:
        values = region_values(source, rel, region, first, min(STEP, region.numel - first))
        codes, scales = q.quantize(values, region.transform)
        back = q.dequantize(codes, scales, region.transform)
        back = q.to_float32(q.from_float32(back, region.dtype), region.dtype)
        # in float64, as verify --against measures it (float32 subtraction would round)
        error = np.abs(back.astype(np.float64) - values.astype(np.float64))
        return codes.tobytes(), scales.astype("<f4").tobytes(), float(error.max(initial=0.0))

    for codes, scales, error in in_order(pool, piece, range(0, region.numel, STEP)):
        out.write(codes)
        out.write(scales)
        worst = max(worst, error)
    region.max_abs_error = worst


def in_order(pool: Executor, fn: Any, items: Any, ahead: int = 4) -> Any:
    """``fn(item)`` for each item, computed on ``pool`` up to ``ahead`` at once, in order."""
    pending: collections.deque[Future[Any]] = collections.deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _dequantized(values: np.ndarray, region: Region) -> bytes:
    """float32 ``values`` (whole blocks from a block boundary of the region) as the decoded
    file holds them."""
    codes, scales = q.quantize(values, region.transform)
    return q.from_float32(q.dequantize(codes, scales, region.transform), region.dtype)


def lossy_bytes(source: Storage, rel: str, region: Region, start: int, end: int) -> bytes:
    """The decoded bytes ``[start, end)`` (file offsets inside ``region``), recomputed from
    the source: the blocks around them are quantized again, as the job did."""
    size = ITEMSIZE[region.dtype]
    e0, e1 = (start - region.offset) // size, -(-(end - region.offset) // size)
    b0 = e0 // q.BLOCK * q.BLOCK
    b1 = min(-(-e1 // q.BLOCK) * q.BLOCK, region.numel)
    data = _dequantized(region_values(source, rel, region, b0, b1 - b0), region)
    skip = start - (region.offset + b0 * size)
    return data[skip : skip + end - start]


def stored_bytes(read: Any, region: Region, at: int, start: int, end: int) -> bytes:
    """The same bytes from the stored codes: ``read(offset, nbytes)`` reads the quantized
    file, where the region's pieces start at ``at``."""
    size = ITEMSIZE[region.dtype]
    e0, e1 = (start - region.offset) // size, -(-(end - region.offset) // size)
    parts = []
    for k in range(e0 // STEP, (e1 - 1) // STEP + 1):
        n = min(STEP, region.numel - k * STEP)
        lo, hi = max(e0, k * STEP) - k * STEP, min(e1, k * STEP + n) - k * STEP
        b0, nb = lo // q.BLOCK, -(-hi // q.BLOCK) - lo // q.BLOCK
        base = at + k * PIECE
        codes = np.frombuffer(read(base + b0 * q.BLOCK, hi - b0 * q.BLOCK), np.int8)
        scales = np.frombuffer(read(base + n + 4 * b0, 4 * nb), "<f4").astype(np.float32)
        data = q.from_float32(q.dequantize(codes, scales, region.transform), region.dtype)
        parts.append(data[(lo - b0 * q.BLOCK) * size : (hi - b0 * q.BLOCK) * size])
    joined = b"".join(parts)
    skip = start - (region.offset + e0 * size)
    return joined[skip : skip + end - start]


def overlay(data: bytearray, at: int, regions: list[Region], produce: Any) -> None:
    """Replace the bytes of ``data`` (file offset ``at``) that lie in ``regions`` with
    ``produce(region, start, end)``."""
    end = at + len(data)
    for r in regions:
        lo, hi = max(at, r.offset), min(end, r.end)
        if lo < hi:
            data[lo - at : hi - at] = produce(r, lo, hi)


# --- zip CRC-32s over quantized bytes ---------------------------------------------------------


def zip_windows(ckpt: Any, rel: str, size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each zip archive in the file: the whole file for ``torch.save``
    files, each record of a DCP ``.distcp`` file."""
    windows = ckpt.record_windows(rel)
    if windows is not None:
        return windows
    with ckpt.storage.open_read(rel) as f:
        return [(0, size)] if zipfile.is_zipfile(f) else []


def crc_patches(
    source: Storage,
    rel: str,
    windows: list[tuple[int, int]],
    regions: list[Region],
    pool: Executor,
) -> list[tuple[int, bytes]]:
    """``(file offset, 4 bytes)``: every CRC-32 field of a zip entry whose data overlaps a
    region, with the CRC of the entry's data as decoded (regions dequantized); entries are
    computed on ``pool``, a few at a time."""
    with source.open_read(rel) as f:
        entries = [e for start, length in windows for e in _entries(f, start, length)]
    touched = [
        e for e in entries if any(r.offset < e["data"][1] and e["data"][0] < r.end for r in regions)
    ]

    def crc_of(entry: dict[str, Any]) -> bytes:
        data_start, data_end = entry["data"]
        value = 0
        for at in range(data_start, data_end, 8 << 20):
            block = bytearray(source.read_range(rel, at, min(8 << 20, data_end - at)))
            overlay(block, at, regions, partial(lossy_bytes, source, rel))
            value = crc32(block, value)
        return struct.pack("<I", value)

    patches: list[tuple[int, bytes]] = []
    for entry, packed in zip(touched, in_order(pool, crc_of, touched), strict=True):
        patches += [(at, packed) for at in entry["crc_at"]]
    return sorted(patches)


def _entries(f: Any, start: int, length: int) -> list[dict[str, Any]]:
    """Each entry of the zip at ``[start, start + length)``: its data span and the file
    offsets of its CRC-32 fields (local header, data descriptor, central directory)."""
    from ckptctl.formats.dcp_container.records import RecordWindow

    window = RecordWindow(f, start, length)
    archive = zipfile.ZipFile(window)
    central = {}
    at = archive.start_dir
    for _ in archive.infolist():
        f.seek(start + at)
        fixed = f.read(46)
        name_len, extra_len, comment_len = struct.unpack("<HHH", fixed[28:34])
        name = f.read(name_len).decode("utf-8", "replace")
        central[name] = start + at + 16
        at += 46 + name_len + extra_len + comment_len
    out = []
    for info in archive.infolist():
        f.seek(start + info.header_offset)
        header = f.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        data_start = start + info.header_offset + 30 + name_len + extra_len
        data_end = data_start + info.compress_size
        crc_at = [central[info.filename]]
        if header[14:18] != b"\0\0\0\0" or not info.flag_bits & 0x08:
            crc_at.append(start + info.header_offset + 14)  # (zero when a descriptor has it)
        if info.flag_bits & 0x08:  # a data descriptor after the data holds it
            f.seek(data_end)
            crc_at.append(data_end + (4 if f.read(4) == b"PK\x07\x08" else 0))
        out.append({"data": (data_start, data_end), "crc_at": crc_at})
    return out


class LossyFile:
    """One file's quantized regions and CRC patches, applied to its blocks as they stream:
    ``stored`` (what is encoded: regions zeroed) and ``decoded`` (what reading gives)."""

    def __init__(self, source: Storage, rel: str, regions: list[Region], patches: list) -> None:
        self.source, self.rel, self.regions, self.patches = source, rel, regions, patches
        self.at: list[int] = []
        """Where each region's pieces start in the quantized file (set as it is written)."""
        self.stored_bytes = 0
        """Size of the quantized file."""

    def _patched(self, at: int, data: bytearray) -> bytearray:
        end = at + len(data)
        for offset, value in self.patches:
            for i, byte in enumerate(value):
                if at <= offset + i < end:
                    data[offset + i - at] = byte
        return data

    def stored(self, at: int, block: bytes) -> bytes:
        data = bytearray(block)
        overlay(data, at, self.regions, lambda r, lo, hi: bytes(hi - lo))
        return bytes(self._patched(at, data))

    def decoded(self, at: int, block: bytes) -> bytes:
        data = bytearray(block)
        overlay(data, at, self.regions, partial(lossy_bytes, self.source, self.rel))
        return bytes(self._patched(at, data))


def to_index(region: Region, at: int) -> list[Any]:
    """``[offset, nbytes, dtype, transform, canonical name, codes offset, max abs error,
    name in the file]``."""
    return [region.offset, region.nbytes, region.dtype, region.transform, region.name, at,
            region.max_abs_error, region.stored_as]  # fmt: skip


def from_index(row: list[Any]) -> tuple[Region, int]:
    offset, nbytes, dtype, transform, name, at, error, stored_as = row
    region = Region(int(offset), int(nbytes), str(dtype), str(transform), str(name))
    region.stored_as, region.max_abs_error = str(stored_as), float(error)
    return region, int(at)
