"""Hostile contents of ``torch.save`` archives, written the way torch writes the rest.

A mutated archive is rebuilt with ``torch.save`` from the base file's own state dict (trusted:
the fuzz suite wrote it), with one value replaced: a tensor whose rebuild call carries hostile
geometry (it references a real storage, so only the geometry lies), an object whose unpickling
names a global off the allow-list, a shared-reference bomb, a deeply nested list. Archives can
also have their ``data.pkl`` replaced by raw pickle bytes.
"""

from __future__ import annotations

import collections
import io
import os
import zipfile
from pathlib import Path
from typing import Any

import torch


class HostileTensor:
    """Unpickles as ``torch._utils._rebuild_tensor_v2(storage, offset, shape, stride)`` with
    the given (hostile) geometry over the real storage of ``like``."""

    def __init__(self, like: torch.Tensor, offset: int, shape: tuple, stride: tuple) -> None:
        self.storage = torch.storage.TypedStorage(
            wrap_storage=like.untyped_storage(), dtype=like.dtype, _internal=True
        )
        self.offset, self.shape, self.stride = offset, shape, stride

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, self.offset, self.shape, self.stride, False, collections.OrderedDict()),
        )


class Forbidden:
    """Unpickles by calling ``os.getcwd`` (harmless, but off every allow-list)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getcwd, ())


class Call:
    """Unpickles as ``func(*args)`` (``builtins.bytearray(3 << 30)``)."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def shared_bomb(levels: int = 40, width: int = 10) -> Any:
    """A few hundred pickled objects that are ``width ** levels`` nodes when walked as a tree."""
    node: Any = [1.0]
    for _ in range(levels):
        node = [node] * width
    return node


def deep_list_pickle(depth: int) -> bytes:
    """Protocol-2 bytes of a list nested ``depth`` deep (``pickle.dumps`` recurses and cannot
    write one this deep): EMPTY_LIST pushed ``depth`` times, then APPENDs fold them."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def load(path: Path) -> Any:
    return torch.load(path, weights_only=False, map_location="cpu")


def save(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def replace_pickle(path: Path, payload: bytes) -> None:
    """Swap the archive's ``data.pkl`` for ``payload``, keeping every storage record."""
    src = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = payload if info.filename.endswith("/data.pkl") else src.read(info.filename)
            dst.writestr(info, data)
    path.write_bytes(out.getvalue())


def first_tensor(tree: Any, path: tuple = ()) -> tuple[tuple, torch.Tensor] | None:
    """The key path of the first tensor in a nested state dict."""
    if isinstance(tree, torch.Tensor):
        return path, tree
    items = (
        tree.items()
        if isinstance(tree, dict)
        else enumerate(tree)
        if isinstance(tree, list | tuple)
        else ()
    )
    for key, value in items:
        found = first_tensor(value, (*path, key))
        if found is not None and found[1].numel() > 1:
            return found
    return None


def set_at(tree: Any, path: tuple, value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    if isinstance(node, tuple):
        raise TypeError("cannot set inside a tuple")
    node[path[-1]] = value
