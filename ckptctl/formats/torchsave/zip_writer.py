"""``torch.save`` archives written as a stream: the pickle first, then each storage in an
aligned zip entry, so a multi-gigabyte shard never has to sit in memory; ``torch.load`` reads
the result. Tensors are pickled as ``TensorSlot`` placeholders that name their storage record.

The pickler subclasses the pure-Python ``pickle._Pickler`` on purpose: only it lets stub classes
(see ``archive``) be saved under their original global names.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import prod
from typing import Any, SupportsIndex

from ckptctl.checksums import record_checks
from ckptctl.checksums.crc import crc32, crc32_combine
from ckptctl.formats.torchsave.archive import _ALIGNMENT
from ckptctl.formats.torchsave.unpickle import Shape, Stub, _stub_type
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.runs import Run, write_in_slices
from ckptctl.model.dtypes import DTYPES, DType, dtype_name

# torch's own names, pickled as globals without importing torch (``torch.load`` resolves them).
_REBUILD_TENSOR = _stub_type("torch._utils", "_rebuild_tensor_v2")


@dataclass(frozen=True, slots=True)
class _StorageSlot:
    key: str
    dtype: DType
    numel: int


class TensorSlot:
    """A tensor to be written: pickled by reference, its bytes streamed later."""

    __slots__ = ("_storage", "dtype", "shape")

    def __init__(self, key: str, dtype: object, shape: Shape) -> None:
        dtype = DTYPES[dtype_name(dtype)]  # a name, a source's DType or torch's own
        self._storage = _StorageSlot(key, dtype, prod(shape))
        self.dtype = dtype
        self.shape = tuple(shape)

    @property
    def key(self) -> str:
        return self._storage.key

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= max(n, 1)
        return (
            _REBUILD_TENSOR,
            (
                self._storage,
                0,
                self.shape,
                tuple(reversed(stride)),
                False,
                collections.OrderedDict(),
            ),
        )


# The pure-Python pickler, whose ``write``/``memoize``/``dispatch`` the stubs do not describe.
_PurePickler: Any = pickle._Pickler


class _Pickler(_PurePickler):
    """Pure-Python pickler: lets stub classes be written under their original global names."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageSlot):
            if obj.dtype.storage is None:
                raise ValueError(f"torch.save has no storage class for {obj.dtype}")
            storage_type = _stub_type("torch", obj.dtype.storage)
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Stub) and obj is not Stub:
            module, qualname = obj._global
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)

    def _save_dtype(self, obj: DType) -> None:
        """A dtype read from a source (``args.params_dtype``) goes back as torch writes its
        own: the global ``torch.<name>``."""
        self.write(pickle.GLOBAL + f"torch\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch = _PurePickler.dispatch.copy()
    dispatch[DType] = _save_dtype


def _aligned_entry(zf: zipfile.ZipFile, name: str, size: int) -> Any:
    """Open a stored zip entry whose data starts on a 64-byte boundary, as torch writes them."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT
    fixed = 30 + len(name.encode()) + (20 if zip64 else 0) + 4
    assert zf.fp is not None  # an open archive
    pad = (-(zf.fp.tell() + fixed)) % _ALIGNMENT
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return zf.open(info, "w", force_zip64=zip64)


_ENTRY_STATE = ("_crc", "_file_size", "_compress_size", "_fileobj", "_compressor")


def _append_run(entry: Any, run: Run) -> None:
    """Append ``run`` to an open zip entry without its bytes passing through Python: the
    entry's file takes the kernel copy and the entry's CRC-32 and sizes are advanced from the
    mapped pages, as its own ``write`` would. zipfile keeps that state in private attributes
    (unchanged from Python 3.6 to 3.14); if a release renames them, or the entry compresses,
    the run goes through ``write`` instead."""
    if not all(hasattr(entry, name) for name in _ENTRY_STATE) or entry._compressor is not None:
        run.write_to(entry)
        return
    if run.crc is not None:
        # The run is a whole source record, checked against its CRC-32 as it passes: the
        # entry's CRC-32 follows from the one before it and the run's (CRC-32 is linear), so
        # the bytes take one pass, not two (a tensor-parallel merge appends whole records).
        run.write_to(entry._fileobj)
        entry._crc = crc32_combine(entry._crc, run.crc, run.nbytes)
    else:
        before, state = entry._crc, [entry._crc]

        def see(view: memoryview) -> None:
            state[0] = crc32(view, state[0])

        run.write_to(entry._fileobj, see, record_seen=run.record is not None)
        entry._crc = state[0]
        if run.record is not None:
            # A part of a source record: its own CRC-32 follows from the entry's before and
            # after it (CRC-32 is linear), so its check costs no pass over the bytes.
            part = state[0] ^ crc32_combine(before, 0, run.nbytes)
            record_checks.saw_piece(run.record, run.offset - run.record.offset, run.nbytes, part)
    entry._file_size += run.nbytes
    entry._compress_size += run.nbytes


def write_torch_zip(
    fileobj: ByteStream,
    tree: Any,
    slots: list[TensorSlot],
    produce: Callable[[TensorSlot], Iterable[bytes | memoryview | Run]],
) -> None:
    """Write ``tree`` (with ``TensorSlot`` leaves) as a ``torch.save`` archive.

    ``produce(slot)`` yields the slot's bytes in order (C-contiguous, little-endian); it is called
    once per slot, in the order of ``slots``, so memory holds one slot's data at a time. A
    ``Run`` among them moves from its source file by a kernel copy where the output allows.
    """
    pkl = io.BytesIO()
    _Pickler(pkl, protocol=2).dump(tree)
    prefix = "archive"
    with zipfile.ZipFile(fileobj, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, payload in (
            ("data.pkl", pkl.getvalue()),
            (".format_version", b"1"),
            (".storage_alignment", str(_ALIGNMENT).encode()),
            ("byteorder", b"little"),
        ):
            with _aligned_entry(zf, f"{prefix}/{name}", len(payload)) as out:
                out.write(payload)
        for slot in slots:
            written = 0
            with _aligned_entry(zf, f"{prefix}/data/{slot.key}", slot.nbytes) as out:
                for chunk in produce(slot):
                    if isinstance(chunk, Run):
                        _append_run(out, chunk)
                        written += chunk.nbytes
                    else:
                        write_in_slices(out, chunk)
                        written += len(chunk)
            if written != slot.nbytes:
                raise AssertionError(f"slot {slot.key}: wrote {written} of {slot.nbytes} bytes")
        with _aligned_entry(zf, f"{prefix}/version", 1) as out:
            out.write(b"3")
