"""Reading option values (sizes, storage options, an HF config) and merging a group of
options into a command's signature: below both the global options and the commands'."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

from pydantic import ByteSize, TypeAdapter

from ckptctl import json_input
from ckptctl.errors import UsageError
from ckptctl.io.multipart import MIN_PART_SIZE
from ckptctl.io.storage import Storage
from ckptctl.settings import StorageConfig


def parse_size(text: str) -> int:
    """``512MiB``, ``2GiB``, ``5GB``, ``1000`` -> bytes (pydantic's ``ByteSize`` reads them)."""
    try:
        return int(_BYTE_SIZE.validate_python(text.strip()))
    except ValueError:
        raise UsageError(f"cannot read size {text!r}; use e.g. 512MiB or 2GiB") from None


_BYTE_SIZE = TypeAdapter(ByteSize)


def _option_value(text: str) -> Any:
    """``true``, ``3``, ``{"a": 1}`` become JSON values; anything else stays a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def storage_config(
    endpoint_url: str | None, options: list[str], part_size: str, upload_parallel: int
) -> StorageConfig:
    """``--endpoint-url``, ``--storage-option key=value`` (values read as JSON when they
    parse), ``--part-size``, ``--upload-parallel``."""
    parsed: dict[str, Any] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            # Only the key is named: the value may be a credential.
            raise UsageError(
                f"--storage-option {key or item[:0]!r}...: expected key=value, e.g. anon=true"
            )
        parsed[key.strip()] = _option_value(value)
    size = parse_size(part_size)
    if size < MIN_PART_SIZE:
        raise UsageError(f"--part-size {part_size}: S3 parts must be at least 5MiB")
    if upload_parallel < 1:
        raise UsageError(f"--upload-parallel {upload_parallel}: must be at least 1")
    return StorageConfig(endpoint_url, parsed, size, upload_parallel)


def read_hf_config(path: str, config: StorageConfig) -> dict[str, Any]:
    """``--hf-config``: a ``config.json`` file, or a directory holding one, on any URL."""
    storage = Storage(path, config)
    rel = "" if not storage.isdir() else "config.json"
    try:
        text = storage.read_text(rel) if rel else storage.fs.cat_file(storage.root).decode()
        return json_input.parse_object(text, f"--hf-config {path}")
    except (OSError, ValueError) as err:
        raise UsageError(f"--hf-config {path}: cannot read an HF config.json ({err})") from None


def with_options(build: Callable[..., Any], into: str) -> Callable[[Callable[..., Any]], Any]:
    """Give a command every option of ``build`` as well (one declaration for commands that
    share a group of options): Typer sees the merged signature, and the command receives
    ``build(**those options)`` as its parameter ``into``. ``build`` runs before the command's
    error boundary, so it only gathers values; they are read and checked in the command."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command, eval_str=True)
        shared = inspect.signature(build, eval_str=True)

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            options = {name: kwargs.pop(name) for name in shared.parameters}
            return command(**kwargs, **{into: build(**options)})

        params = [p for p in own.parameters.values() if p.name != into]
        at = next((i for i, p in enumerate(params) if p.default is not p.empty), len(params))
        params[at:at] = shared.parameters.values()
        run.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate
