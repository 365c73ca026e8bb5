"""Global storage flags: how remote stores are reached and written."""

from __future__ import annotations

import json
from typing import Any

from ckptctl.cli.commands import parse_size
from ckptctl.errors import UsageError
from ckptctl.multipart import MIN_PART_SIZE
from ckptctl.storage import Storage, StorageConfig


def _option_value(text: str) -> Any:
    """``true``, ``3``, ``{"a": 1}`` become JSON values; anything else stays a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def storage_config(
    endpoint_url: str | None, options: list[str], part_size: str, upload_parallel: int
) -> StorageConfig:
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


def read_hf_config(path: str) -> dict[str, Any]:
    """``--hf-config``: a ``config.json`` file, or a directory holding one, on any URL."""
    storage = Storage(path)
    rel = "" if not storage.isdir() else "config.json"
    try:
        text = storage.read_text(rel) if rel else storage.fs.cat_file(storage.root).decode()
        config = json.loads(text)
    except (OSError, ValueError) as err:
        raise UsageError(f"--hf-config {path}: cannot read an HF config.json ({err})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--hf-config {path}: not a JSON object")
    return config
