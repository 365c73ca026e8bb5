"""The registry: the only list of checkpoint formats.

Built-in formats are imported on first use (their readers import torch; ``--help`` and other
commands that touch no checkpoint do not pay for it). ``register`` adds one from outside, e.g.
a test's toy format: probing asks it first.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from ckptctl.errors import UsageError
from ckptctl.formats.base import CheckpointFormat, Writer
from ckptctl.formats.options import FormatOption
from ckptctl.formats.target import TargetFormat

BUILTIN = ("torch_dist", "dcp", "deepspeed", "verl", "accelerate", "megatron", "hf", "torch_file")
"""Folders under ``ckptctl/formats`` whose ``format.py`` exports ``FORMAT`` (or ``FORMATS``), in
probing order
(``torch_dist`` before plain DCP and Megatron: it lives in a Megatron iteration directory as
DCP files; DeepSpeed before Megatron: its ``mp_rank_00_model_states.pt`` is no rank directory)."""

_added: list[CheckpointFormat] = []


@cache
def _builtin() -> tuple[CheckpointFormat, ...]:
    out: list[CheckpointFormat] = []
    for name in BUILTIN:
        module = importlib.import_module(f"ckptctl.formats.{name}.format")
        # A folder may hold related formats (DeepSpeed ZeRO and its universal checkpoints).
        out += getattr(module, "FORMATS", (module.FORMAT,))
    return tuple(out)


def formats() -> tuple[CheckpointFormat, ...]:
    return (*_added, *_builtin())


def register(fmt: CheckpointFormat) -> None:
    if fmt.name in {f.name for f in formats()}:
        raise ValueError(f"a format named {fmt.name!r} is already registered")
    _added.append(fmt)


def unregister(name: str) -> None:
    _added[:] = [f for f in _added if f.name != name]


def named(name: str) -> CheckpointFormat:
    for fmt in formats():
        if fmt.name == name:
            return fmt
    raise KeyError(name)


def writer_for(kind: str) -> tuple[CheckpointFormat, Writer]:
    """The format that writes files of ``kind``, and its writer."""
    for fmt in formats():
        if kind in fmt.writers:
            return fmt, fmt.writers[kind]
    raise KeyError(f"no registered format writes {kind!r} files")


def targets(operation: str) -> tuple[TargetFormat, ...]:
    """The formats ``operation`` (``consolidate``, ``reshard``) may write, in registry order."""
    return tuple(
        f.target for f in formats() if f.target is not None and operation in f.target.operations
    )


def target(name: str, operation: str) -> TargetFormat:
    """The target format ``--format name`` of ``operation`` means."""
    for fmt in targets(operation):
        if fmt.name == name:
            return fmt
    choices = ", ".join(t.name for t in targets(operation))
    raise UsageError(f"{operation} --format {name}: choose one of {choices}")


def option(name: str) -> FormatOption[Any] | None:
    """The option some registered format reads under ``name``."""
    for fmt in formats():
        for declared in fmt.options:
            if declared.name == name:
                return declared
    return None
