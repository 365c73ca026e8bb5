"""A directory of ``.npy`` files, one named tensor each (``<name>.npy``): read-only."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from ckptctl.arrays import dtype_of
from ckptctl.checksums.integrity import Targets
from ckptctl.formats.base import Checkpoint, CheckpointFormat, ProbeRequest
from ckptctl.formats.support import FormatSupport
from ckptctl.io.storage import Storage
from ckptctl.model.geometry import Piece
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.stored import CheckpointView, FlatView, KeyPath, Shape, StoredFile, StoredTensor

NAME = "npy-dir"


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
    return tuple(shape), dtype_of(np.empty(0, dtype))


def probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> NpyCheckpoint | None:
    if request.file is not None or not names or not all(n.endswith(".npy") for n in names):
        return None
    files = []
    for rel in sorted(names):
        shape, dtype = _header(storage, rel)
        zero = (0,) * len(shape)
        name = rel.removesuffix(".npy")
        tensor = StoredTensor((name,), name, shape, dtype, (Piece(zero, zero, shape),))
        files.append(StoredFile(rel, (tensor,)))
    view = CheckpointView(NAME, None, ParallelLayout(), tuple(files), notes=("toy format",))
    return NpyCheckpoint(storage, view)


FORMAT = CheckpointFormat(
    NAME,
    probe,
    support=FormatSupport(
        NAME, "a directory of .npy files", "*.npy", True, "", "named tensors", "none"
    ),
    integrity=lambda ckpt: Targets(unchecked=["npy files carry no checksum"]),
)
