"""Boxes of tensor elements as numpy arrays: how bytes move through a job without torch.

Moving a checkpoint's bytes needs no tensor math: boxes are read, sliced, transposed, copied
into bands and hashed. numpy does all of that, imports in a tenth of torch's time and releases
the GIL on large copies, so readers return numpy arrays and the executor builds bands from them.
torch is imported only for what only it defines exactly: casts between dtypes (its rounding and
NaN bits are what users' training code produces) and value comparisons.

Every torch dtype maps to one numpy dtype of the same size. numpy has no bfloat16 or float8, so
those elements are held as a one-field structured dtype whose field is named after the torch
dtype: the array still knows what its bytes are, and views of it as plain integer words
(``words``) copy and transpose at memcpy speed.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptctl.model.dtypes import DTYPES, DType, dtype_name

if TYPE_CHECKING:
    import torch

_NATIVE = {
    "float64",
    "float32",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex64",
    "complex128",
}


def _numpy_dtype(d: DType) -> np.dtype:
    if d.name in _NATIVE:
        return np.dtype(d.name).newbyteorder("<")
    return np.dtype([(d.name, f"<u{d.itemsize}")])


NUMPY_DTYPES: dict[str, np.dtype] = {name: _numpy_dtype(d) for name, d in DTYPES.items()}
_BY_NUMPY = {dt: name for name, dt in NUMPY_DTYPES.items()}
_WORDS = {n: np.dtype(f"<u{n}") for n in (1, 2, 4, 8)}


def numpy_dtype(dtype: object) -> np.dtype:
    """The numpy dtype holding elements of ``dtype`` (a torch name, ``DType`` or torch dtype)."""
    return NUMPY_DTYPES[dtype_name(dtype)]


def dtype_of(array: np.ndarray) -> str:
    """The torch name of ``array``'s elements."""
    return _BY_NUMPY[array.dtype]


def words(array: np.ndarray) -> np.ndarray:
    """``array`` viewed as unsigned integers of its element size (no copy): what copies,
    transposes and fills work on, whatever the elements mean."""
    size = array.dtype.itemsize
    return array.view(_WORDS[size]) if size in _WORDS else array.view(np.uint8)


def interleave_halves(array: np.ndarray) -> np.ndarray:
    """Dim 0's two halves interleaved: row 2j is the first half's row j, 2j + 1 the
    second's (a gated tensor as GPT-OSS stores it)."""
    half = array.shape[0] // 2
    out = np.empty_like(array)
    out[0::2], out[1::2] = array[:half], array[half:]
    return out


def interleaved_rows(first: int, count: int, rows: int) -> np.ndarray:
    """Where canonical rows ``[first, first + count)`` of a gated tensor of ``rows`` rows lie
    when its halves are interleaved (``interleave_halves``)."""
    half = rows // 2
    canonical = np.arange(first, first + count)
    return np.where(canonical < half, 2 * canonical, 2 * (canonical - half) + 1)


def packed_block_box(
    read_stored: Callable[[tuple[int, ...], tuple[int, ...]], np.ndarray],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    rows: int,
    transposed: bool,
    interleaved: bool,
) -> np.ndarray:
    """Box ``(offsets, sizes)``, in Megatron's orientation and row order, of one expert's block
    of a packed tensor (GPT-OSS's as transformers holds it) that has ``rows`` rows in that
    orientation and is stored transposed and/or with its gated halves interleaved:
    ``read_stored(offsets, sizes)`` reads a box of the block as stored; the stored rows that
    span the box are read, then turned and put in order."""
    if interleaved:
        order = interleaved_rows(offsets[0], sizes[0], rows)
        lo, hi = int(order.min()), int(order.max()) + 1
    else:
        order, lo, hi = None, offsets[0], offsets[0] + sizes[0]
    if transposed:
        box = read_stored((offsets[1], lo), (sizes[1], hi - lo)).T
    else:
        box = read_stored((lo, *offsets[1:]), (hi - lo, *sizes[1:]))
    return np.ascontiguousarray(box if order is None else box[order - lo])


def empty(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.empty(shape, NUMPY_DTYPES[dtype])


def full(shape: tuple[int, ...], dtype: str, value: float) -> np.ndarray:
    """``shape`` filled with ``value`` as torch would store it in ``dtype``."""
    out = empty(shape, dtype)
    if value == 0 and math.copysign(1.0, value) > 0:
        words(out).fill(0)  # +0 is all zero bits in every dtype
    elif dtype in _NATIVE:
        out.fill(value)
    else:
        import torch

        one = torch.full((), value, dtype=getattr(torch, dtype))
        words(out).fill(int(words(from_torch(one)).reshape(-1)[0]))
    return out


def cast(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array``'s values in ``dtype``: ``array`` itself when it is already so, else torch's
    conversion (the bits a training run would produce)."""
    if dtype_of(array) == dtype:
        return array
    import torch

    return from_torch(to_torch(array).to(getattr(torch, dtype)))


def shifted(array: np.ndarray, by: float, name: str, hint: str | None = None) -> np.ndarray:
    """``array + by`` rounded once to its dtype, as torch adds; refused (``CheckpointError``
    naming ``name``, then ``hint`` or a word on a wider dtype) unless subtracting ``by`` gives
    back every original bit: the shift between two spellings of one weight must lose
    nothing."""
    from ckptctl.errors import CheckpointError

    original = to_torch(array)
    out = original + by
    back = words(from_torch(out - by))
    bad = back != words(np.ascontiguousarray(array))
    if bad.any():
        where = int(np.flatnonzero(bad.reshape(-1))[0])
        value = float(original.reshape(-1)[where].float())
        dtype = dtype_of(array)
        wider = hint or (
            "pass --dtype fp32, which holds it exactly, or --allow-rounding to round it"
            if array.dtype.itemsize < 4
            else "no dtype ckptctl writes holds it; keep this model in a format that stores "
            "the weight as it is (Megatron, torch_dist, DCP), or pass --allow-rounding"
        )
        raise CheckpointError(
            f"{name}: element {where} ({value!r}) {'plus' if by > 0 else 'minus'} {abs(by):g} "
            f"is not exact in {dtype}, and the target stores this weight shifted by {by:g}: "
            f"{wider}",
        )
    return from_torch(out)


def shifted_rounded(array: np.ndarray, by: float) -> tuple[np.ndarray, float]:
    """``array + by`` rounded once to its dtype, as torch adds (``--allow-rounding``), and
    the largest error it makes in the unshifted values: ``|(out - by) - array|``, computed
    exactly in float64."""
    original = to_torch(array)
    out = original + by
    error = ((out.double() - by) - original.double()).abs().max()
    return from_torch(out), float(error) if original.numel() else 0.0


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory (read-only arrays come from fetched bytes that
    nothing writes into)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if array.dtype.names is None:
            return torch.from_numpy(array)
        # bfloat16, float8, ...: numpy holds them as words, which torch reinterprets.
        raw = words(np.ascontiguousarray(array)).reshape(-1)
        flat = torch.from_numpy(raw.view(f"<i{raw.dtype.itemsize}"))
    return flat.view(getattr(torch, dtype_of(array))).reshape(array.shape)


def from_torch(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing a CPU tensor's memory (made contiguous first if it is not)."""
    import torch

    flat = tensor.contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    return raw.view(numpy_dtype(tensor.dtype)).reshape(tuple(tensor.shape))


def buffer(array: np.ndarray) -> memoryview:
    """``array``'s memory as a ``memoryview`` (numpy's type stubs grant arrays the buffer
    protocol only from Python 3.12; the arrays have it on every version)."""
    memory: Any = array
    return memoryview(memory)


def raw_bytes(array: np.ndarray) -> memoryview:
    """The little-endian bytes of ``array`` in C order (without a copy if it is contiguous)."""
    if not array.size:
        return memoryview(b"")
    return buffer(np.ascontiguousarray(words(array)).reshape(-1)).cast("B")


def finite(array: np.ndarray) -> bool:
    """No NaN or infinity among floating-point elements (True for other dtypes)."""
    name = dtype_of(array)
    if not DTYPES[name].is_floating_point:
        return True
    if name in _NATIVE:
        return bool(np.isfinite(array).all())
    if name == "bfloat16":  # all exponent bits set is infinity or NaN
        return not bool(((words(array) & 0x7F80) == 0x7F80).any())
    import torch

    return bool(torch.isfinite(to_torch(array).float()).all())


def first_value(array: np.ndarray) -> Any:
    """The first element as a Python number (Adam's step kept as a tensor)."""
    if array.dtype.names is None:
        return array.reshape(-1)[0].item()
    return to_torch(array).reshape(-1)[0].item()


def strided(flat: np.ndarray, sizes: tuple[int, ...], stride: tuple[int, ...]) -> np.ndarray:
    """The box of ``sizes`` elements laid out by ``stride`` (in elements) from ``flat``'s
    first, as a C-contiguous array (``flat`` itself, reshaped, when it already is one)."""
    box = _box_view(flat, sizes, stride)
    if box.flags.c_contiguous:
        return flat[: math.prod(sizes)].reshape(sizes)
    return np.ascontiguousarray(box)


def _box_view(flat: np.ndarray, sizes: tuple[int, ...], stride: tuple[int, ...]) -> np.ndarray:
    """The box as a read-only view of ``flat`` (no copy)."""
    size = flat.dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        flat, sizes, tuple(s * size for s in stride), writeable=False
    )


def box_from_file(
    fd: int,
    offset: int,
    nbytes: int,
    dtype: object,
    sizes: tuple[int, ...],
    stride: tuple[int, ...],
    into: np.ndarray | None = None,
    check: Callable[[memoryview], object] | None = None,
) -> np.ndarray:
    """The box of ``sizes`` elements laid out by ``stride`` (in elements) from byte ``offset``
    of file ``fd``, whose elements span ``nbytes`` from there, copied once out of a read-only
    map of the file's pages: into ``into`` (same dtype and shape, any layout: a box of a
    band) or a new C-contiguous array. Reading the span into memory and copying the box out
    of it passes over every byte twice, and over the bytes between the box's rows too (half
    of all, when a tensor-parallel shard is split in two). ``check`` sees the mapped span
    first (a whole record's CRC-32). The caller makes sure the file holds the span: a map past
    a file's end kills the process on first touch."""
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    pages = mmap.mmap(fd, offset + nbytes - base, prot=mmap.PROT_READ, offset=base)
    try:
        out = _copy_box(memoryview(pages)[offset - base :], dtype, sizes, stride, into, check)
    finally:
        with contextlib.suppress(BufferError):  # an error left a view alive: the GC unmaps
            pages.close()
    return out


def _copy_box(
    span: memoryview,
    dtype: object,
    sizes: tuple[int, ...],
    stride: tuple[int, ...],
    into: np.ndarray | None,
    check: Callable[[memoryview], object] | None,
) -> np.ndarray:
    with span:
        if check is not None:
            check(span)
        flat = np.frombuffer(span, numpy_dtype(dtype))
        box = _box_view(flat, sizes, stride)
        out = np.empty(sizes, flat.dtype) if into is None else into
        if flat.dtype.itemsize in _WORDS:
            words(out)[...] = words(box)
        else:
            out[...] = box
        del flat, box  # the map is released only once nothing views it
    return out
