"""The safetensors header, read strictly: the one parser every reader and ``verify`` use.

A safetensors file is an 8-byte little-endian header length, a JSON object of tensors (dtype,
shape, ``data_offsets`` relative to the end of the header) and the tensors' bytes. The header is
untrusted: each tensor's fields must have their types, its byte range must match its dtype and
shape and lie inside the data area, no two tensors may share bytes, and a name may appear once;
anything else is refused naming the file and the tensor, before a byte of data is read.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from math import prod
from typing import BinaryIO

from ckptctl.errors import CheckpointError
from ckptctl.json_input import int_list, parse_object
from ckptctl.model.dtypes import BY_SAFETENSORS, ITEMSIZE

MAX_HEADER = 100_000_000


@dataclass(frozen=True, slots=True)
class SafetensorsEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Absolute file offset of the first byte."""
    end: int


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    tensors: dict[str, SafetensorsEntry]
    data_start: int
    """File offset where the data area begins (8 + header length)."""
    data_end: int
    """File offset just past the last tensor's bytes (``data_start`` when there is none)."""


def read_header(f: BinaryIO, where: str, file_size: int) -> SafetensorsHeader:
    """Parse and check the header of the safetensors file ``f`` of ``file_size`` bytes."""
    raw = f.read(8)
    if len(raw) < 8:
        raise CheckpointError(f"{where}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER or 8 + n > file_size:
        raise CheckpointError(
            f"{where}: a safetensors header of {n} bytes does not fit the file's {file_size}; "
            "the file is truncated or not safetensors"
        )
    header = parse_object(f.read(n), f"{where} (header)", unique_keys=True)
    data_start = 8 + n
    tensors: dict[str, SafetensorsEntry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _entry(name, meta, where, data_start, file_size)
    ranges = sorted((e.begin, e.end, name) for name, e in tensors.items() if e.end > e.begin)
    for (_, end, first), (begin, _, second) in itertools.pairwise(ranges):
        if begin < end:
            raise CheckpointError(f"{where}: tensors {first} and {second} share bytes")
    data_end = max((e.end for e in tensors.values()), default=data_start)
    return SafetensorsHeader(tensors, data_start, data_end)


def _entry(name: str, meta: object, where: str, data_start: int, size: int) -> SafetensorsEntry:
    what = f"{where}: tensor {name}"
    if not isinstance(meta, dict):
        raise CheckpointError(f"{what}: header entry is not an object")
    named = meta.get("dtype")
    dtype = BY_SAFETENSORS.get(named) if isinstance(named, str) else None
    if dtype is None:
        raise CheckpointError(f"{what} has unsupported dtype {meta.get('dtype')}")
    shape = int_list(meta.get("shape"), "its shape", what)
    begin, end = int_list(meta.get("data_offsets"), "its data_offsets", what, length=2)
    if end < begin or end - begin != prod(shape) * ITEMSIZE[dtype]:
        raise CheckpointError(f"{what}: byte range {begin}..{end} does not match its shape")
    if data_start + end > size:
        raise CheckpointError(f"{what} lies past the end of the file; the file is truncated")
    return SafetensorsEntry(dtype, shape, data_start + begin, data_start + end)
