"""The one dtype table: each element type checkpoints hold, by torch name, with its size and
its spelling in safetensors headers and in ``torch.save`` pickles (no torch import)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, repr=False)
class DType:
    """An element type without torch: what reading a checkpoint's metadata needs (``plan``
    and ``inspect`` never import torch). Prints and pickles as ``torch.<name>``."""

    name: str
    """torch's name without ``torch.``, as DCP ``.metadata`` pickles it."""
    itemsize: int
    safetensors: str | None = None
    """The header code (``F32``), if safetensors can store it."""
    storage: str | None = None
    """The legacy storage class ``torch.save`` pickles for it (``FloatStorage``)."""

    @property
    def is_floating_point(self) -> bool:
        """As torch says: real floating types (not complex, not integers)."""
        return self.name.startswith(("float", "bfloat"))

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    __str__ = __repr__


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float64", 8, "F64", "DoubleStorage"),
        DType("float32", 4, "F32", "FloatStorage"),
        DType("float16", 2, "F16", "HalfStorage"),
        DType("bfloat16", 2, "BF16", "BFloat16Storage"),
        DType("int64", 8, "I64", "LongStorage"),
        DType("int32", 4, "I32", "IntStorage"),
        DType("int16", 2, "I16", "ShortStorage"),
        DType("int8", 1, "I8", "CharStorage"),
        DType("uint8", 1, "U8", "ByteStorage"),
        DType("bool", 1, "BOOL", "BoolStorage"),
        DType("uint16", 2, "U16"),
        DType("uint32", 4, "U32"),
        DType("uint64", 8, "U64"),
        DType("complex32", 4),
        DType("complex64", 8, None, "ComplexFloatStorage"),
        DType("complex128", 16, None, "ComplexDoubleStorage"),
        DType("float8_e4m3fn", 1, "F8_E4M3"),
        DType("float8_e4m3fnuz", 1),
        DType("float8_e5m2", 1, "F8_E5M2"),
        DType("float8_e5m2fnuz", 1),
        DType("float8_e8m0fnu", 1),
        DType("float4_e2m1fn_x2", 1),
    )
}

ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}
BY_SAFETENSORS = {d.safetensors: name for name, d in DTYPES.items() if d.safetensors}
BY_STORAGE = {d.storage: name for name, d in DTYPES.items() if d.storage}


def dtype_name(dtype: object) -> str:
    """``torch.float32`` (or ``"float32"``, or its ``DType``) -> ``"float32"``."""
    return dtype.name if isinstance(dtype, DType) else str(dtype).removeprefix("torch.")


NUMBER_FORMATS = {
    "float64": "<d",
    "float32": "<f",
    "float16": "<e",
    "bfloat16": "<f",  # the upper half of a float32
    "int64": "<q",
    "int32": "<i",
    "int16": "<h",
    "int8": "<b",
    "uint8": "<B",
    "bool": "<?",
}
"""``struct`` formats of the dtypes whose single values are decoded and encoded without numpy
(Adam's step, an iteration count, a fill)."""


def unpack_number(dtype: str, data: bytes) -> float:
    """The value of one little-endian element of ``dtype`` (a key of ``NUMBER_FORMATS``)."""
    if dtype == "bfloat16":
        data = b"\0\0" + data
    return float(struct.unpack(NUMBER_FORMATS[dtype], data)[0])


def pack_exactly(dtype: str, value: float) -> bytes | None:
    """One element of ``dtype`` holding ``value``, when ``value`` is exactly representable in it
    (then these are the bytes any conversion stores); ``None`` otherwise (rounding, overflow,
    NaN: left to torch's own conversion)."""
    fmt = NUMBER_FORMATS.get(dtype)
    value = float(value)  # an int step would lack is_integer (Python 3.11)
    if fmt is None or math.isnan(value):
        return None
    number: float | int | bool = value
    if fmt[1] in "qihbB?":
        if not value.is_integer() or (fmt[1] == "?" and value not in (0, 1)):
            return None
        number = bool(value) if fmt[1] == "?" else int(value)
    try:
        data = struct.pack(fmt, number)
    except (struct.error, OverflowError):  # out of the dtype's range
        return None
    if dtype == "bfloat16":
        if data[:2] != b"\0\0":  # needs more than bfloat16's 8 bits of mantissa
            return None
        data = data[2:]
    back = unpack_number(dtype, data)
    if back != value or math.copysign(1.0, back) != math.copysign(1.0, value):
        return None
    return data
