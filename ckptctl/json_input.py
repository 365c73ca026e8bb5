"""JSON documents read from checkpoints and destinations, which are untrusted input.

``json.loads`` turns a hostile document into exceptions of every kind (``RecursionError`` for
deep nesting, ``TypeError`` later when a field has the wrong type) or a huge allocation. Here a
document is size-limited, parsed with nesting errors caught, duplicate keys refused where they
would hide one of two values, and its top level checked; the typed accessors below check a
field's type where it is used, so a wrong type is a one-line ``CheckpointError`` naming the
file and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ckptctl.errors import CheckpointError

MAX_DOCUMENT = 256 << 20
"""Largest JSON document read (a safetensors header of a 10k-tensor shard is a few MB)."""


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(f"key {key!r} appears twice")
        out[key] = value
    return out


def parse(text: str | bytes, where: str, *, unique_keys: bool = False) -> Any:
    """A JSON value, or a ``CheckpointError`` naming ``where``."""
    if len(text) > MAX_DOCUMENT:
        raise CheckpointError(f"{where}: a JSON document of {len(text)} bytes is implausible")
    hook = _no_duplicates if unique_keys else None
    try:
        return json.loads(text, object_pairs_hook=hook)
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply to be a checkpoint's") from None
    except _Duplicate as err:
        raise CheckpointError(f"{where}: {err}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{where}: not JSON ({err})") from None


def parse_object(text: str | bytes, where: str, *, unique_keys: bool = False) -> dict[str, Any]:
    """A JSON object (a ``dict``), or a ``CheckpointError`` naming ``where``."""
    value = parse(text, where, unique_keys=unique_keys)
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a JSON object, found {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def field(
    doc: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str, default: Any = ...
) -> Any:
    """``doc[name]`` of type ``kind`` (``int`` never accepts a boolean), or the ``default`` when
    absent (no default: the field is required)."""
    if name not in doc:
        if default is ...:
            raise CheckpointError(f"{where}: field {name!r} is missing")
        return default
    value = doc[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise CheckpointError(f"{where}: field {name!r} is {_kind(value)}, not {_names(kinds)}")
    if not isinstance(value, kinds):
        raise CheckpointError(f"{where}: field {name!r} is {_kind(value)}, not {_names(kinds)}")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    said: dict[type, str] = {dict: "an object", list: "a list"}
    return " or ".join(said.get(k, k.__name__) for k in kinds)


def int_list(value: Any, what: str, where: str, *, length: int | None = None) -> tuple[int, ...]:
    """A list of non-negative integers (shapes, offsets), as a tuple."""
    ok = isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )
    if not ok or (length is not None and len(value) != length):
        size = f"{length} " if length is not None else ""
        raise CheckpointError(f"{where}: {what} must be a list of {size}non-negative integers")
    return tuple(value)
