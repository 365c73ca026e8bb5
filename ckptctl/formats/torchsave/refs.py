"""Finding tensors in an unpickled ``torch.save`` tree: follow a key path, view a slice of a flat
tensor, open a file lazily (by byte range on object stores). Shared by every format whose files
are ``torch.save`` archives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from ckptctl.formats.base import Checkpoint
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.io.runs import Span
from ckptctl.io.storage import Storage
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.stored import CheckpointView, FlatView, KeyPath, Shape

if TYPE_CHECKING:
    import numpy as np


def resolve(tree: Any, key: KeyPath) -> Any:
    """Follow ``key`` into ``tree``; ``"a|b"`` names a dict key that is a tuple of dtypes (the
    grad-buffer keys of ``distrib_optim.pt``), which JSON plans cannot spell directly."""
    node = tree
    for name in key:
        part: Any = name
        if isinstance(part, str) and "|" in part and isinstance(node, dict) and part not in node:
            part = next(
                (k for k in node if isinstance(k, tuple) and "|".join(map(dtype_name, k)) == part),
                part,
            )
        node = node[part]
    return node


def view_ref(ref: TensorRef, offset: int, shape: tuple[int, ...]) -> TensorRef:
    """Elements ``[offset, offset + numel)`` of a flat tensor (or of a C-contiguous one, in
    memory order), viewed with ``shape``."""
    if len(ref.shape) == 1:
        step = ref.stride[0]
    elif tuple(ref.stride) == contiguous_strides(ref.shape):
        step = 1
    else:
        raise ValueError(f"cannot view a slice of a non-contiguous tensor {list(ref.shape)}")
    return TensorRef(ref.storage, ref.offset + offset * step, shape, contiguous_strides(shape))


def read_box(
    reader: TorchZipReader,
    key: KeyPath,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    view: tuple[int, tuple[int, ...]] | None = None,
    transposed: bool = False,
    into: np.ndarray | None = None,
) -> np.ndarray:
    """Box ``[offsets, offsets + sizes)`` of the tensor at ``key`` (or of its flat ``view``);
    a ``transposed`` tensor's box is given, and returned, in the canonical orientation.
    ``into``: where the bytes may go straight from the file (see ``TorchZipReader.read``)."""
    ref = resolve(reader.tree, key)
    if transposed:  # read the stored box, hand it back in canonical orientation
        if view is not None:
            view = (view[0], view[1][::-1])
        offsets, sizes = offsets[::-1], sizes[::-1]
    if view is not None:
        ref = view_ref(ref, *view)
    if transposed:
        return reader.read(ref, offsets, sizes).T
    return reader.read(ref, offsets, sizes, into)


def span_of_box(
    reader: TorchZipReader,
    key: KeyPath,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    view: tuple[int, tuple[int, ...]] | None = None,
    *,
    covering: bool = False,
) -> Span | None:
    """Where ``read_box`` would read the box, when it lies contiguously in the file, or with
    ``covering`` the bytes a read of it touches (see ``TorchZipReader.span``)."""
    ref = resolve(reader.tree, key)
    if view is not None:
        ref = view_ref(ref, *view)
    return reader.span(ref, offsets, sizes, covering=covering)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def open_torch_file(storage: Storage, rel: str) -> TorchZipReader:
    """A lazy reader of one ``torch.save`` file; on remote stores its tensor bytes are fetched
    by exact byte range, in parallel when the executor asks for several."""
    fetch = None if storage.is_local else partial(storage.read_range, rel)
    stored = stored_object(storage, rel)
    return TorchZipReader(
        storage.open_read(rel), storage.describe(rel), fetch, (rel, 0), stored, storage.checks
    )


def stored_object(storage: Storage, rel: str) -> tuple[str, Callable[[], str]] | None:
    """An object's URL and what tells its content (``TorchZipReader``'s ``stored``, so its
    records read in parts are checked); ``None`` for a local file."""
    if storage.is_local:
        return None
    return storage.describe(rel), partial(storage.identity, rel)


@dataclass
class TorchFiles(Checkpoint):
    """A checkpoint kept as ``torch.save`` files: its view for planners and one lazy reader
    per file, read box by box (DeepSpeed's ZeRO and universal checkpoints build on it)."""

    storage: Storage
    view: CheckpointView
    readers: dict[str, TorchZipReader]
    reads_into: ClassVar[bool] = True
    locates: ClassVar[bool] = True

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: Shape,
        sizes: Shape,
        view: FlatView = None,
        transposed: bool = False,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        return read_box(self.readers[path], key, offsets, sizes, view, transposed, into)

    def where(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        """Where the box lies in file ``path``, when ``read`` would read it contiguously."""
        return span_of_box(self.readers[path], key, offsets, sizes, view)

    def extent(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        """The bytes of file ``path`` a read of the box touches, contiguous or not."""
        return span_of_box(self.readers[path], key, offsets, sizes, view, covering=True)
