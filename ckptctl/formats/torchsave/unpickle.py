"""The restricted unpickler of ``torch.save`` pickles: tensors become ``TensorRef`` records
naming their storage and geometry, a short allow-list of plain classes is rebuilt, classes of
known training libraries become inert ``Stub`` records, and anything else is refused by name.
Nothing in a checkpoint is executed (checkpoints are untrusted input)."""

from __future__ import annotations

import argparse
import collections
import copyreg
import functools
import io
import pathlib
import pickle
import types
from dataclasses import dataclass
from math import prod
from typing import Any

from ckptctl.errors import CheckpointError, UnsafePickleError
from ckptctl.formats.torchsave.dtensor import DTENSOR, dtensor_ref
from ckptctl.model.dtypes import BY_STORAGE, DTYPES, DType

Shape = tuple[int, ...]

_STORAGE_DTYPES = {storage: DTYPES[name] for storage, name in BY_STORAGE.items()}


@dataclass(frozen=True, slots=True)
class StorageRef:
    key: str
    dtype: DType
    numel: int


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor in an archive, not yet read: its storage record and view geometry."""

    storage: StorageRef
    offset: int
    shape: Shape
    stride: Shape

    @property
    def dtype(self) -> DType:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Stub:
    """An inert stand-in for an allow-listed foreign object (Megatron enums, numpy RNG state).

    It records how it was built so it can be pickled back under the same global name; nothing
    of the foreign class is imported or run.
    """

    _global: tuple[str, str] = ("", "")
    _args: tuple[Any, ...]
    _state: Any
    _newobj: bool
    """Built as pickle's ``NEWOBJ`` builds it (``cls.__new__(cls, *args)``, no ``__init__``):
    pickled back the same way, since calling the real class may need other arguments."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Stub:
        obj = super().__new__(cls)
        obj._args = args
        obj._state = None
        obj._newobj = True  # until ``__init__`` says the class was called
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._newobj = False

    def __setstate__(self, state: Any) -> None:
        self._state = state

    def __reduce__(self) -> tuple[Any, ...]:
        if self._newobj:
            newobj = copyreg.__newobj__  # type: ignore[attr-defined]
            return (newobj, (type(self), *self._args), self._state)
        return (type(self), self._args, self._state)

    def __repr__(self) -> str:
        module, name = self._global
        return f"<{module}.{name}{self._args!r}>"


_stub_types: dict[tuple[str, str], type[Stub]] = {}


def _stub_type(module: str, name: str) -> type[Stub]:
    key = (module, name)
    if key not in _stub_types:
        _stub_types[key] = type(name, (Stub,), {"_global": key, "__module__": "ckptctl.stubs"})
    return _stub_types[key]


class _StorageType:
    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype


def _rebuild_tensor(
    storage: StorageRef, offset: int, shape: Any, stride: Any, *_: Any
) -> TensorRef:
    return TensorRef(storage, int(offset), tuple(shape), tuple(stride))


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


class _PlainTensorType:
    """``torch.Tensor`` or ``torch.nn.Parameter`` named as the type a tensor is rebuilt as."""


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any, *, where: str) -> Any:
    """A tensor pickled with Python attributes (Megatron's fp32 master copies carry
    ``tensor_model_parallel``, ``partition_dim``, ...): rebuilt by an allow-listed function as
    a plain tensor, or a parameter; the attributes are dropped. A DTensor (a wrapper subclass
    whose state holds its local tensor and spec) becomes a ``DTensorRef``."""
    if func is _stub_type(*_WRAPPER) and new_type is _stub_type(*DTENSOR):
        return dtensor_ref(state, where, args)
    if func not in (_rebuild_tensor, _rebuild_parameter) or not isinstance(
        new_type, _PlainTensorType
    ):
        raise UnsafePickleError(
            f"{where}: refusing to rebuild a tensor as {new_type!r} with {func!r}; the file "
            "may be malicious or from an unsupported tool"
        )
    if not isinstance(state, dict | None):
        raise UnsafePickleError(f"{where}: unexpected tensor attributes {type(state).__name__}")
    return func(*args)


def _bytearray(source: Any = b"", *rest: Any) -> bytearray:
    """``bytearray`` as pickles use it: a copy of bytes the pickle holds. ``bytearray(n)``
    would allocate ``n`` zero bytes a pickle of a few bytes can ask for (3 GiB from a 1 MB
    file): refused."""
    if not isinstance(source, bytes | bytearray | str):
        raise CheckpointError(
            f"bytearray({type(source).__name__}) in a pickle: only copies of pickled bytes "
            "are rebuilt"
        )
    return bytearray(source, *rest)


_REAL_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): lambda *args: _bytearray(*args),
    ("_codecs", "encode"): lambda text, encoding="utf-8": text.encode(encoding),
    ("io", "BytesIO"): io.BytesIO,
    ("_io", "BytesIO"): io.BytesIO,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "Path"): pathlib.PurePosixPath,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch", "Tensor"): _PlainTensorType(),
    ("torch.nn.parameter", "Parameter"): _PlainTensorType(),
    ("torch", "Size"): tuple,
}
# Protocol 2 (torch.save's) names the builtins module as Python 2 did.
_REAL_GLOBALS |= {
    ("__builtin__", n): f for (m, n), f in list(_REAL_GLOBALS.items()) if m == "builtins"
}
# Foreign objects that Megatron files legitimately hold; never imported, kept as stubs.
_STUB_PREFIXES = (
    "megatron.",
    "numpy.",
    "numpy",
    "torch._C",
    "transformer_engine.",
    "deepspeed.",  # loss scaler, ZeRO stage enum, fragment addresses
    "torch.distributed.",  # a DTensor's spec, device mesh and placements
)
# Standard-library values Megatron-LM keeps in ``args`` (``exit_signal = signal.SIGTERM``):
# rebuilt as stubs too, since calling the real class is never needed to read them.
_STUB_GLOBALS = frozenset({("signal", "Signals")})
# A DTensor's pickle (verl's per-rank FSDP files): ``torch.distributed`` classes (spec, mesh,
# placements) and the wrapper-subclass rebuild are kept as stubs, read by ``dtensor``.
_WRAPPER = ("torch._utils", "_rebuild_wrapper_subclass")
_STUB_GLOBALS |= {_WRAPPER, ("torch.serialization", "_get_layout")}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _REAL_GLOBALS:
            return _REAL_GLOBALS[(module, name)]
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return functools.partial(_rebuild_from_type, where=self._where)
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name in DTYPES:
            return DTYPES[name]  # written back as the same global
        if (
            (module, name) == ("torch", "device")
            or (module, name) in _STUB_GLOBALS
            or module.startswith(_STUB_PREFIXES)
        ):
            return _stub_type(module, name)
        raise UnsafePickleError(
            f"{self._where}: refusing pickled global {module}.{name} (not on the allow-list); "
            "the file may be malicious or from an unsupported tool"
        )

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"{self._where}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise UnsafePickleError(f"{self._where}: unexpected storage type {storage_type!r}")
        return StorageRef(str(key), storage_type.dtype, int(numel))


def restricted_loads(data: bytes, where: str) -> Any:
    """Unpickle ``data`` allowing only the globals checkpoints need; ``where`` names the source.
    The result is a tree ckptctl may walk: no deeper than ``MAX_DEPTH``, and no larger than
    ``MAX_NODES`` when shared references are walked as often as they are referenced."""
    try:
        tree = _RestrictedUnpickler(data, where).load()
    except CheckpointError as err:
        raise type(err)(f"{where}: {err}" if where not in str(err) else str(err)) from None
    except Exception as err:
        raise CheckpointError(f"{where}: cannot unpickle ({type(err).__name__}: {err})") from None
    census(tree, where)
    return tree


MAX_DEPTH = 256
"""Deepest nesting of containers a checkpoint's pickle may hold (Megatron's: under 20)."""
MAX_NODES = 2_000_000
"""Most containers and values a pickle may hold when walked as a tree (a Megatron rank file
of a large model: a few hundred thousand)."""


def census(tree: Any, where: str) -> None:
    """Refuse a tree too deep, or too large when walked: a few kilobytes of pickle can hold
    a list nested 200,000 deep, or ``width ** levels`` paths through shared references, either
    of which would exhaust every walk ckptctl makes of it."""
    stack: list[tuple[Any, int]] = [(tree, 0)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise CheckpointError(
                f"{where}: its pickle holds more than {MAX_NODES:,} values when walked (shared "
                "references repeated); refusing it as a pickle bomb"
            )
        if depth > MAX_DEPTH:
            raise CheckpointError(
                f"{where}: its pickle nests containers more than {MAX_DEPTH} deep; refusing it"
            )
        if isinstance(node, dict):
            children: Any = [*node.keys(), *node.values()]
        elif isinstance(node, list | tuple | set | frozenset):
            children = node
        elif isinstance(node, Stub):
            children = (node._args, node._state)
        elif hasattr(node, "args") and hasattr(node, "state"):  # a recorder (DCP .metadata)
            children = (node.args, node.state)
        elif isinstance(node, argparse.Namespace | types.SimpleNamespace):
            children = list(vars(node).values())
        else:
            continue
        stack.extend((child, depth + 1) for child in children)
