"""Parsing ``.metadata`` safely: torch loads it with unrestricted ``pickle.load``, so a
checkpoint from anywhere can run code the moment it is opened. Here it is unpickled with an
allow-list: every global the pickle names is looked up in a fixed table *before* anything is
called, and the allowed DCP classes resolve to inert recorders (``_Raw``), never to torch's
classes. A second pass turns the recorded states into the frozen records of ``metadata`` and
refuses anything malformed, including storage paths that leave the checkpoint directory.

Format facts (torch 2.13, confirmed with ``pickletools.dis`` on files torch and megatron-core
0.16.1 wrote): dataclasses arrive as NEWOBJ + BUILD with their ``__dict__``; ``TensorProperties``
builds from a 5-tuple whose layout is a call ``torch.serialization._get_layout("torch.strided")``;
``MetadataIndex`` omits ``offset`` for byte items; ``_StorageInfo`` omits
``transform_descriptors`` when there are none; megatron-core adds ``all_local_plans`` (its cached
``SavePlan`` objects) and older releases ``mcore_data`` to the ``Metadata`` attributes. Pure: no
I/O and no torch import.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, ClassVar, TypeGuard

from ckptctl.errors import CheckpointError, UnsafePickleError
from ckptctl.formats.dcp_container.metadata import (
    DTYPE_NAMES,
    BytesEntry,
    Chunk,
    DcpMetadata,
    KeyPath,
    SaveInfo,
    StorageInfo,
    StorageKey,
    TensorEntry,
    unsafe_path_reason,
)
from ckptctl.formats.torchsave.unpickle import census
from ckptctl.model.geometry import Shape

_LAYOUTS = frozenset(
    {"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "jagged"}
)


_DCP = "torch.distributed.checkpoint.metadata"


_SHARDED = "torch.distributed._shard.sharded_tensor.metadata"  # older TensorProperties home


_FS = "torch.distributed.checkpoint.filesystem"


_PLANNER = "torch.distributed.checkpoint.planner"


_MCORE = "megatron.core.dist_checkpointing.strategies.torch"


# Allowed classes and what we call them. Several spellings may share one kind; anything not
# interpreted below (plans, enums) is still recorded, only never looked at.
_CLASS_KINDS: dict[tuple[str, str], str] = {
    (_DCP, "Metadata"): "Metadata",
    # megatron-core <= 0.15: a Metadata subclass carrying ``mcore_data``; 0.16 keeps an empty
    # placeholder of this name so such files unpickle.
    (_MCORE, "MCoreMetadata"): "Metadata",
    (_DCP, "TensorStorageMetadata"): "TensorStorageMetadata",
    (_DCP, "ChunkStorageMetadata"): "ChunkStorageMetadata",
    (_DCP, "BytesStorageMetadata"): "BytesStorageMetadata",
    (_DCP, "MetadataIndex"): "MetadataIndex",
    (_DCP, "TensorProperties"): "TensorProperties",
    (_SHARDED, "TensorProperties"): "TensorProperties",
    (_DCP, "StorageMeta"): "StorageMeta",
    (_FS, "_StorageInfo"): "StorageInfo",
    (_DCP, "_MEM_FORMAT_ENCODING"): "MemoryFormat",
    (_SHARDED, "MEM_FORMAT_ENCODING"): "MemoryFormat",
    # megatron-core's cached save plans (``Metadata.all_local_plans``); never interpreted.
    (_FS, "_StoragePrefix"): "StoragePrefix",
    (_PLANNER, "SavePlan"): "SavePlan",
    (_MCORE, "MCoreSavePlan"): "SavePlan",
    (_PLANNER, "WriteItem"): "WriteItem",
    (_PLANNER, "WriteItemType"): "WriteItemType",
    (_PLANNER, "TensorWriteData"): "TensorWriteData",
    (_PLANNER, "BytesIOWriteData"): "BytesIOWriteData",
}


class _Raw:
    """An allow-listed pickled object, recorded without running any code of its real class.

    Pickle builds dataclasses with ``cls.__new__(cls)`` then ``obj.__setstate__(state)`` and
    enums with ``cls(value)``; all three only store their arguments here.
    """

    __slots__ = ("args", "state")
    kind: ClassVar[str] = ""
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any) -> _Raw:
        obj = super().__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state


_RAW_TYPES: dict[str, type[_Raw]] = {
    kind: type(kind, (_Raw,), {"__slots__": (), "kind": kind, "__module__": __name__})
    for kind in set(_CLASS_KINDS.values())
}


def _layout(name: Any) -> str:
    """Stands in for ``torch.serialization._get_layout``: checks the name, returns it."""
    if not (isinstance(name, str) and name.removeprefix("torch.") in _LAYOUTS):
        raise ValueError(f"unknown tensor layout {name!r}")
    return name


def _path_maker(flavour: type[PurePosixPath] | type[PureWindowsPath]) -> Callable[..., str]:
    """Stands in for ``pathlib`` path classes (``StorageMeta.checkpoint_id``): a plain string."""

    def make(*parts: Any) -> str:
        if not all(isinstance(p, str) for p in parts):
            raise ValueError(f"path parts {parts!r} are not strings")
        return str(flavour(*parts))

    return make


_posix_path, _windows_path = _path_maker(PurePosixPath), _path_maker(PureWindowsPath)

_PATH_CLASSES = {
    "PosixPath": _posix_path,
    "PurePosixPath": _posix_path,
    "WindowsPath": _windows_path,
    "PureWindowsPath": _windows_path,
}


_CALLABLES: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): _layout,
    # Python 3.13 pickles its path classes as ``pathlib._local.PosixPath`` (checked with 3.13.0).
    **{(m, n): f for m in ("pathlib", "pathlib._local") for n, f in _PATH_CLASSES.items()},
}


def _resolve(module: str, name: str) -> Any:
    """The stand-in for global ``module.name``, or None if it is not on the allow-list."""
    if (module, name) in _CLASS_KINDS:
        return _RAW_TYPES[_CLASS_KINDS[(module, name)]]
    if (module, name) in _CALLABLES:
        return _CALLABLES[(module, name)]
    if module == "torch" and name in DTYPE_NAMES:
        return name
    if module == "torch" and name in _LAYOUTS:  # older spelling: the layout as a plain global
        return f"torch.{name}"
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        resolved = _resolve(module, name)
        if resolved is None:
            raise UnsafePickleError(
                f"{self._where}: refusing pickled global {module}.{name} (not on the DCP "
                "metadata allow-list); nothing was executed. The file may be malicious or "
                "written by an unsupported tool"
            )
        return resolved

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._where}: unexpected persistent id {pid!r} in .metadata")


# --- parsing -----------------------------------------------------------------------------------


def parse_metadata(data: bytes, where: str) -> DcpMetadata:
    """Read the bytes of a DCP ``.metadata`` file; ``where`` names it in errors.

    Raises ``UnsafePickleError`` for a global outside the allow-list (before anything is
    called) and ``CheckpointError`` for anything else malformed, including a record path that
    leaves the checkpoint directory. Coverage is checked separately (``metadata_problems``).
    """
    try:
        root = _MetadataUnpickler(data, where).load()
    except UnsafePickleError:
        raise
    except Exception as err:
        raise CheckpointError(f"{where}: cannot unpickle .metadata ({err})") from None
    census(root, where)
    try:
        return _metadata(root)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: malformed .metadata: {err}") from None


_KNOWN_ATTRS = {"state_dict_metadata", "storage_data", "planner_data", "storage_meta", "version"}


def _metadata(root: Any) -> DcpMetadata:
    state = _state(root, "Metadata", "the top-level object")
    extras = sorted(k for k in state if k not in _KNOWN_ATTRS | {"mcore_data"})
    ignored = [f"Metadata.{k}" for k in extras]
    planner_data = _planner_data(state.get("planner_data"))
    if planner_data is None and state.get("planner_data"):
        ignored.append("Metadata.planner_data (not an FQN -> key path mapping)")
    mcore_data = _plain(state.get("mcore_data"))
    if mcore_data is _NOT_PLAIN:
        mcore_data = None
        ignored.append("Metadata.mcore_data (holds objects, not plain data)")
    version = state.get("version")
    if version is not None and not isinstance(version, str):
        raise ValueError(f"version {version!r} is not a string")
    return DcpMetadata(
        entries=_entries(state.get("state_dict_metadata")),
        storage=_storage(state.get("storage_data")),
        planner_data=planner_data,
        save_info=_save_info(state.get("storage_meta")),
        version=version,
        mcore_data=mcore_data,
        ignored=tuple(ignored),
    )


def _state(obj: Any, kind: str, what: str) -> dict[str, Any]:
    """The attribute dict of a recorded ``kind`` object (empty if it was never built)."""
    if not isinstance(obj, _Raw) or obj.kind != kind:
        raise ValueError(f"{what} is {_describe(obj)}, expected {kind}")
    if obj.state is None:
        return {}
    if not isinstance(obj.state, dict) or not all(isinstance(k, str) for k in obj.state):
        raise ValueError(f"{what}: {kind} state is {_describe(obj.state)}, expected a dict")
    return obj.state


def _describe(obj: Any) -> str:
    return obj.kind if isinstance(obj, _Raw) else type(obj).__name__


def _shape(value: Any, what: str) -> Shape:
    """A ``torch.Size`` (unpickled as a tuple) of non-negative ints."""
    if not isinstance(value, tuple | list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"{what} is {value!r}, expected a tuple of ints")
    return tuple(value)


def _entries(value: Any) -> dict[str, TensorEntry | BytesEntry]:
    if not isinstance(value, dict):
        raise ValueError(f"state_dict_metadata is {_describe(value)}, expected a dict")
    entries: dict[str, TensorEntry | BytesEntry] = {}
    for fqn, item in value.items():
        if not isinstance(fqn, str):
            raise ValueError(f"item name {fqn!r} is not a string")
        if isinstance(item, _Raw) and item.kind == "BytesStorageMetadata":
            entries[fqn] = BytesEntry()
        else:
            entries[fqn] = _tensor_entry(fqn, _state(item, "TensorStorageMetadata", fqn))
    return entries


def _tensor_entry(fqn: str, state: dict[str, Any]) -> TensorEntry:
    chunks = state.get("chunks")
    if not isinstance(chunks, list):
        raise ValueError(f"{fqn}: chunks is {_describe(chunks)}, expected a list")
    return TensorEntry(
        dtype=_dtype(fqn, state.get("properties")),
        shape=_shape(state.get("size"), f"{fqn}: size"),
        chunks=tuple(_chunk(fqn, c) for c in chunks),
    )


def _dtype(fqn: str, properties: Any) -> str:
    if not isinstance(properties, _Raw) or properties.kind != "TensorProperties":
        raise ValueError(f"{fqn}: properties is {_describe(properties)}")
    state = properties.state
    # torch writes the 5-tuple of TensorProperties.__getstate__; a dict is the plain-dataclass
    # form, accepted in case an older writer used it.
    dtype = state[0] if isinstance(state, tuple) and state else None
    if isinstance(state, dict):
        dtype = state.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
        raise ValueError(f"{fqn}: dtype {dtype!r} is not a known torch dtype")
    return dtype


def _chunk(fqn: str, raw: Any) -> Chunk:
    state = _state(raw, "ChunkStorageMetadata", f"{fqn}: chunk")
    return Chunk(
        offsets=_shape(state.get("offsets"), f"{fqn}: chunk offsets"),
        sizes=_shape(state.get("sizes"), f"{fqn}: chunk sizes"),
    )


def _storage(value: Any) -> dict[StorageKey, StorageInfo]:
    if not isinstance(value, dict):
        raise ValueError(
            f"storage_data is {_describe(value)}, not FileSystemWriter's record index; "
            "the checkpoint was written by an unsupported storage writer"
        )
    storage: dict[StorageKey, StorageInfo] = {}
    for raw_index, raw_info in value.items():
        key = _storage_key(raw_index)
        if key in storage:
            raise ValueError(f"two storage entries for {key[0]} at offsets {key[1]}")
        storage[key] = _storage_info(key, raw_info)
    return storage


def _storage_key(raw: Any) -> StorageKey:
    state = _state(raw, "MetadataIndex", "a storage_data key")
    fqn, offset = state.get("fqn"), state.get("offset")  # ``index`` is a lookup hint: ignored
    if not isinstance(fqn, str):
        raise ValueError(f"storage_data key names {fqn!r}, not a string")
    return fqn, None if offset is None else _shape(offset, f"{fqn}: storage offset")


def _storage_info(key: StorageKey, raw: Any) -> StorageInfo:
    where = f"{key[0]} at offsets {key[1]}" if key[1] is not None else key[0]
    state = _state(raw, "StorageInfo", f"storage_data[{where}]")
    path, offset, length = (state.get(k) for k in ("relative_path", "offset", "length"))
    transforms = state.get("transform_descriptors") or ()
    if not isinstance(path, str):
        raise ValueError(f"{where}: relative_path {path!r} is not a string")
    reason = unsafe_path_reason(path)
    if reason:
        raise ValueError(f"{where}: record path {path!r} {reason}; refusing to read outside it")
    if not (_strict_int(offset) and _strict_int(length)):
        raise ValueError(f"{where}: byte range ({offset!r}, {length!r}) is not two ints")
    if not isinstance(transforms, list | tuple) or not all(isinstance(t, str) for t in transforms):
        raise ValueError(f"{where}: transform_descriptors {transforms!r} are not strings")
    return StorageInfo(
        relative_path=path, offset=offset, length=length, transform_descriptors=tuple(transforms)
    )


def _planner_data(value: Any) -> dict[str, KeyPath] | None:
    """``{fqn: key path}`` as torch's DefaultSavePlanner writes it; None for anything else."""
    if not isinstance(value, dict) or not value:
        return None
    mapping: dict[str, KeyPath] = {}
    for fqn, path in value.items():
        if not (
            isinstance(fqn, str)
            and isinstance(path, tuple | list)
            and all(isinstance(p, str | int) and not isinstance(p, bool) for p in path)
        ):
            return None
        mapping[fqn] = tuple(path)
    return mapping


def _save_info(value: Any) -> SaveInfo | None:
    if value is None:
        return None
    state = _state(value, "StorageMeta", "storage_meta")
    texts = {k: state.get(k) for k in ("checkpoint_id", "save_id", "load_id")}
    modules = state.get("modules") or ()
    if (
        not all(v is None or isinstance(v, str) for v in texts.values())
        or not isinstance(modules, list | tuple)
        or not all(isinstance(m, str) for m in modules)
    ):
        raise ValueError(f"storage_meta fields {state!r} are not strings")
    return SaveInfo(**texts, modules=tuple(modules))


_NOT_PLAIN = object()


_PLAIN_DEPTH = 32  # deeper is a hostile self-reference, not megatron's per-key dicts


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` if it is built of dicts, lists, tuples and scalars only, else ``_NOT_PLAIN``."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if depth >= _PLAIN_DEPTH or not isinstance(value, dict | list | tuple):
        return _NOT_PLAIN
    if isinstance(value, dict):
        items = [(_plain(k, depth + 1), _plain(v, depth + 1)) for k, v in value.items()]
        if any(k is _NOT_PLAIN or v is _NOT_PLAIN for k, v in items):
            return _NOT_PLAIN
        return dict(items)
    parts = [_plain(v, depth + 1) for v in value]
    return _NOT_PLAIN if any(p is _NOT_PLAIN for p in parts) else type(value)(parts)


# --- checking ----------------------------------------------------------------------------------


def _strict_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
