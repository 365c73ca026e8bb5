"""``.metadata`` pickled without importing torch: the objects torch's ``FileSystemReader``
unpickles (``Metadata``, ``TensorStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``, ...),
written under their torch global names with the state each class pickles itself with.

Importing torch and ``torch.distributed.checkpoint`` only to pickle these few dataclasses costs
about two seconds per job, more than writing a small checkpoint. The classes' pickled forms are
stable across torch 2.x: plain dataclasses pickle as ``NEWOBJ`` plus their ``__dict__``;
``TensorProperties`` and ``_StorageInfo`` define ``__getstate__``; ``torch.Size`` and the layout
reduce to calls. ``tests/formats/dcp/test_dcp_metadata.py``
unpickles the result with torch and compares it
with the same metadata built from torch's own classes.
"""

from __future__ import annotations

import copyreg
import io
from typing import Any

from ckptctl.formats.dcp_container.metadata import BytesEntry, DcpMetadata, TensorEntry
from ckptctl.formats.torchsave.unpickle import Stub
from ckptctl.formats.torchsave.zip_writer import _Pickler
from ckptctl.model.dtypes import DTYPES

_DCP = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_CONTIGUOUS_FORMAT = 0
"""``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT``: how ``TensorProperties`` pickles
``torch.contiguous_format``."""

_classes: dict[tuple[str, str], type[_Pickled]] = {}


class _Pickled(Stub):
    """An object pickled as ``reduce`` says (its class named by its torch global)."""

    _reduce: tuple[Any, ...] = ()

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:  # type: ignore[override]
        return self._reduce


def _cls(module: str, name: str) -> type[_Pickled]:
    key = (module, name)
    if key not in _classes:
        _classes[key] = type(name, (_Pickled,), {"_global": key, "__module__": "ckptctl.stubs"})
    return _classes[key]


_NEWOBJ: Any = getattr(copyreg, "__newobj__")  # noqa: B009 (not in copyreg's type stubs)
"""What ``object.__reduce_ex__`` names as the constructor of a bare instance."""


def _instance(module: str, name: str, state: Any = None) -> _Pickled:
    """An instance as ``object.__reduce_ex__`` pickles one: created bare, then its state set."""
    cls = _cls(module, name)
    obj = cls()
    obj._reduce = (_NEWOBJ, (cls,), state)
    return obj


def _call(module: str, name: str, *args: Any) -> _Pickled:
    """A value pickled as a call ``module.name(*args)`` (``torch.Size``, the layout, enums)."""
    obj = _cls(module, name)()
    obj._reduce = (_cls(module, name), args)
    return obj


def _size(values: tuple[int, ...]) -> _Pickled:
    return _call("torch", "Size", tuple(values))


def _entry(e: TensorEntry | BytesEntry) -> _Pickled:
    if isinstance(e, BytesEntry):
        return _instance(_DCP, "BytesStorageMetadata")
    properties = _instance(
        _DCP,
        "TensorProperties",
        (
            DTYPES[e.dtype],
            _call("torch.serialization", "_get_layout", "torch.strided"),
            False,  # requires_grad
            _call(_DCP, "_MEM_FORMAT_ENCODING", _CONTIGUOUS_FORMAT),
            False,  # pin_memory
        ),
    )
    chunks = [
        _instance(
            _DCP, "ChunkStorageMetadata", {"offsets": _size(c.offsets), "sizes": _size(c.sizes)}
        )
        for c in e.chunks
    ]
    return _instance(
        _DCP,
        "TensorStorageMetadata",
        {"properties": properties, "size": _size(e.shape), "chunks": chunks},
    )


def metadata_pickle(md: DcpMetadata, protocol: int) -> bytes:
    """``md`` pickled as torch pickles its own ``Metadata`` (checked by the caller)."""
    storage = {}
    for (fqn, offsets), info in md.storage.items():
        index = _instance(
            _DCP,
            "MetadataIndex",
            {"fqn": fqn, "index": None, "offset": None if offsets is None else _size(offsets)},
        )
        fields = {
            "relative_path": info.relative_path,
            "offset": info.offset,
            "length": info.length,
            "transform_descriptors": list(info.transform_descriptors) or None,
        }
        # ``_StorageInfo.__getstate__`` leaves out what is None.
        state = {k: v for k, v in fields.items() if v is not None}
        storage[index] = _instance(_FILESYSTEM, "_StorageInfo", state)
    storage_meta = None
    if md.save_info is not None:
        meta = md.save_info
        storage_meta = _instance(
            _DCP,
            "StorageMeta",
            {
                "checkpoint_id": meta.checkpoint_id,
                "save_id": meta.save_id,
                "load_id": meta.load_id,
                "modules": list(meta.modules),
            },
        )
    # torch's planners look key paths up in planner_data; a flat name is its own path.
    planner_data = md.planner_data or {fqn: (fqn,) for fqn in md.entries}
    state = {
        "state_dict_metadata": {fqn: _entry(e) for fqn, e in md.entries.items()},
        "planner_data": dict(planner_data),
        "storage_data": storage,
        "storage_meta": storage_meta,
        "version": md.version,
    }
    if md.mcore_data:
        # megatron-core <= 0.14 reads the original shape of each N-D flattened tensor here (its
        # Metadata subclass's attribute; on torch's own class an extra attribute all the same).
        state["mcore_data"] = {k: dict(v) for k, v in md.mcore_data.items()}
    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(_instance(_DCP, "Metadata", state))
    return buf.getvalue()
