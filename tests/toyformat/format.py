"""A directory of ``.npy`` files, one named tensor each (``<name>.npy``), read and written: the
test-only format proving that a new format, as a source and as a target, is this one folder and
one ``registry.register`` (no enum, no branch elsewhere)."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from ckptctl.arrays import dtype_of
from ckptctl.checksums.integrity import Targets
from ckptctl.errors import CheckpointError, UsageError
from ckptctl.formats.base import Checkpoint, CheckpointFormat, ProbeRequest, WriteJob
from ckptctl.formats.support import FormatSupport
from ckptctl.formats.target import CONSOLIDATE, TargetFormat
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.runs import Run, write_in_slices
from ckptctl.io.storage import Storage
from ckptctl.model.catalog import is_state
from ckptctl.model.geometry import Piece
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import FileWrite
from ckptctl.model.stored import (
    CheckpointView,
    FlatView,
    KeyPath,
    Shape,
    StoredFile,
    StoredTensor,
    canonical_shapes,
)
from ckptctl.model.target import TargetFiles, TargetRequest

NAME = "npy-dir"
NPY = "npy"
"""``FileWrite.kind`` of one ``.npy`` file."""
OWN = "ckptctl."
"""ckptctl's own files beside the tensors (the manifest)."""


@dataclass
class NpyCheckpoint(Checkpoint):
    storage: Storage
    view: CheckpointView

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: Shape,
        sizes: Shape,
        view: FlatView = None,
        *,
        transposed: bool = False,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        array = np.load(io.BytesIO(self.storage.read_range(path, 0, self.storage.size(path))))
        box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        return np.ascontiguousarray(array[box]).astype(array.dtype.newbyteorder("<"))


def _header(storage: Storage, rel: str) -> tuple[tuple[int, ...], str]:
    with storage.open_read(rel) as f:
        major, _ = np.lib.format.read_magic(f)
        read = (
            np.lib.format.read_array_header_1_0
            if major == 1
            else np.lib.format.read_array_header_2_0
        )
        shape, _, dtype = read(f)
        start = f.tell()
    expected = start + int(np.prod(shape)) * dtype.itemsize
    if storage.size(rel) != expected:
        raise CheckpointError(f"{rel}: {storage.size(rel)} bytes, its header says {expected}")
    return tuple(shape), dtype_of(np.empty(0, dtype))


def probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> NpyCheckpoint | None:
    tensors = {n for n in names if not n.startswith(OWN)}
    if request.file is not None or not tensors or not all(n.endswith(".npy") for n in tensors):
        return None
    files = []
    for rel in sorted(tensors):
        shape, dtype = _header(storage, rel)
        zero = (0,) * len(shape)
        name = rel.removesuffix(".npy")
        tensor = StoredTensor((name,), name, shape, dtype, (Piece(zero, zero, shape),))
        files.append(StoredFile(rel, (tensor,)))
    view = CheckpointView(NAME, None, ParallelLayout(), tuple(files), notes=("toy format",))
    return NpyCheckpoint(storage, view)


class NpyTarget(TargetFormat):
    """Every weight whole, one ``<canonical name>.npy`` each."""

    name = NAME
    operations = (CONSOLIDATE,)
    help = "one .npy file per weight"
    moves_optimizer_state = False

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        files = []
        for name, (shape, dtype) in sorted(canonical_shapes(source).items()):
            dtype = request.dtype or dtype
            if is_state(name):
                continue
            if dtype not in NUMPY_NATIVE:
                raise UsageError(f"{name} is {dtype}, which .npy cannot hold: give --dtype")
            zero = (0,) * len(shape)
            tensor = StoredTensor((name,), name, shape, dtype, (Piece(zero, zero, shape),))
            files.append(StoredFile(f"{name}.npy", (tensor,)))
        return TargetFiles(tuple(files), NPY, ParallelLayout(), "every weight whole, one file each")


NUMPY_NATIVE = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def write_npy(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    """One ``.npy`` file: numpy's header, then the tensor's bytes as the plan assembles them."""
    (tensor,) = file.tensors
    header = {"descr": np.dtype(tensor.dtype).str, "fortran_order": False, "shape": tensor.shape}
    np.lib.format.write_array_header_1_0(out, header)
    job.assemble.expect(file.tensors)
    for chunk in job.assemble.chunks(tensor, file.path):
        if isinstance(chunk, Run):
            chunk.write_to(out)
        else:
            write_in_slices(out, chunk)


FORMAT = CheckpointFormat(
    NAME,
    probe,
    support=FormatSupport(
        NAME, "a directory of .npy files", "*.npy", True, "", "named tensors", "none"
    ),
    integrity=lambda ckpt: Targets(unchecked=["npy files carry no checksum"]),
    target=NpyTarget(),
    writers={NPY: write_npy},
)
