"""Read a single ``torch.save`` state dict (``state_dict.pt``, as ``consolidate --format torch``
and torch's ``dcp_to_torch_save`` write): every tensor is its own canonical tensor, named by
its key path joined with dots, which is how DCP flattens the same state dict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptctl.formats.torch_file.names import STATE_DICT_FILE
from ckptctl.formats.torchsave.archive import TensorRef
from ckptctl.formats.torchsave.refs import TorchFiles, open_torch_file
from ckptctl.io.storage import Storage
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.geometry import Piece
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.stored import (
    CheckpointView,
    Format,
    KeyPath,
    StoredFile,
    StoredTensor,
)

if TYPE_CHECKING:
    pass


def _tensors(tree: Any, path: KeyPath = ()) -> list[tuple[KeyPath, TensorRef]]:
    if isinstance(tree, TensorRef):
        return [(path, tree)]
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in _tensors(v, (*path, k))]
    if isinstance(tree, list | tuple):
        return [x for i, v in enumerate(tree) for x in _tensors(v, (*path, i))]
    return []


def probe_torch_file(storage: Storage, rel: str = STATE_DICT_FILE) -> TorchFiles:
    reader = open_torch_file(storage, rel)
    tensors = []
    for key, ref in _tensors(reader.tree):
        zero = (0,) * len(ref.shape)
        tensors.append(
            StoredTensor(
                key,
                ".".join(map(str, key)),
                ref.shape,
                dtype_name(ref.dtype),
                (Piece(zero, zero, ref.shape),),
            )
        )
    view = CheckpointView(
        Format.TORCH,
        None,
        ParallelLayout(),
        (StoredFile(rel, tuple(tensors)),),
        None,
        any(k.startswith("optim") for t in tensors for k in [t.canonical]),
        (f"one torch.save state dict: {len(tensors)} tensors",),
    )
    return TorchFiles(storage, view, {rel: reader})
