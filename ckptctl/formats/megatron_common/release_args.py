"""Megatron-LM's own argument defaults, per release, as data: which fields its parser has and
the value each release gives them by default (``release_args.json``, made by
``tools/megatron_release_args.py`` from Megatron-LM's parser). Pure lookups, no I/O beyond
reading the packaged table once.

A field Megatron-LM sets to its default leaves the model what the fields ckptctl maps say: so
``args`` are judged by value, and a field ckptctl does not know by name is accepted at a default
of some release, never at any other value."""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
from importlib import resources
from typing import Any

from ckptctl.formats.torchsave.unpickle import Stub
from ckptctl.model.dtypes import DType


@functools.cache
def _table() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("release_args.json").read_text("utf-8")
    table: dict[str, Any] = json.loads(text)
    return table


def releases() -> list[str]:
    """The Megatron-LM releases whose parsers the table was made from, oldest first."""
    return list(_table()["releases"])


@functools.cache
def derived_names() -> frozenset[str]:
    """The fields ``validate_args`` of some release derives from others: their values depend
    on the model, so they are judged by ckptctl's classes, never by the table."""
    return frozenset(_table()["derived"])


def derived(name: str) -> bool:
    return name in derived_names()


def parser_fields() -> frozenset[str]:
    """Every field some release's parser has."""
    return frozenset(_table()["values"])


def at_default(name: str, value: Any) -> bool:
    """Whether ``value`` (as unpickled from a checkpoint) is the default some release's parser
    gives ``name``; False for fields no parser has and for derived ones."""
    if derived(name):
        return False
    defaults = _table()["values"].get(name)
    if defaults is None:
        return False
    plain = plain_value(value)
    return any(same(plain, default) for default in defaults)


def plain_value(value: Any) -> Any:
    """A value of ``args`` in the table's JSON terms: lists for sequences, ``{"torch.dtype":
    name}`` for a dtype, ``{"enum": class, "value": v}`` for an enum (an inert ``Stub``), a
    path's text; anything else as ``{"repr": type}`` (which no default equals)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [plain_value(item) for item in value]
    if isinstance(value, dict):
        return {str(key): plain_value(item) for key, item in value.items()}
    if isinstance(value, DType):
        return {"torch.dtype": value.name}
    if isinstance(value, Stub) and len(value._args) == 1 and value._state is None:
        module, name = value._global
        return {"enum": f"{module}.{name}", "value": plain_value(value._args[0])}
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, argparse.Namespace):
        return {"repr": "Namespace"}
    return {"repr": type(value).__name__}


def same(value: Any, default: Any) -> bool:
    """Equality that keeps ``True`` apart from ``1`` and ``1.0`` apart from ``"1.0"``; an int
    enum (``signal.Signals``) equals the integer an ``IntEnum`` default is stored as."""
    if isinstance(value, dict) and "enum" in value and not isinstance(default, dict):
        return same(value["value"], default)
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool) and value == default
    if isinstance(value, int | float) and isinstance(default, int | float):
        return value == default
    if isinstance(value, list) and isinstance(default, list):
        return len(value) == len(default) and all(map(same, value, default))
    if isinstance(value, dict) and isinstance(default, dict):
        return value.keys() == default.keys() and all(same(value[k], default[k]) for k in value)
    return type(value) is type(default) and bool(value == default)
