"""Settings: one explicit value the CLI builds from its flags and passes down.

A library caller builds its own (``Settings(storage=StorageConfig(endpoint_url=...))``) or takes
the defaults; nothing is read from module globals or context variables, so no caller inherits
another's configuration unawares. Pure values: no fsspec, no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

S3_RETRIES = {"max_attempts": 10, "mode": "standard"}
"""botocore's own retry policy: exponential backoff with jitter on throttling (503 SlowDown),
5xx and dropped connections."""

S3_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 60}
"""Seconds; a dead endpoint is also caught up front by ``check_endpoint``."""

REMOTE_READ_PARALLEL = 8
"""Ranged GETs in flight when a source is on an object store (each answers after a round trip);
``ckptctl calibrate`` measures read bandwidth the same way."""

REMOTE_FILES_AT_ONCE = 4
"""Files of an object-store target written at once by default: a file's reads and its upload
run mostly one after the other (its last parts upload after its last reads), so other files
must read while one uploads. Through a 5 MB/s link (``bench/bench_nodes.py``, one node), one
file at a time left reads idle at the end of every file; two took the reshard from 156.9 to
140.6 s; four took it to 131.2 s and the consolidate to HF (24 MiB shards) from 66.1 to 47.3 s.
They share the memory budget, and the parts two files had in flight (``upload_parallel`` each):
upload memory does not grow with the number of files."""

MOST_AT_ONCE = 16
"""Upper bound of the defaults taken from the machine's cores: beyond it a local disk's queue,
not the CPUs, sets the pace (``--read-parallel`` / ``--files-at-once`` go further)."""


def cores() -> int:
    """CPUs this process may run on (its affinity, as a container or ``taskset`` sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on every platform
        return os.cpu_count() or 1


def default_read_parallel(local: bool) -> int:
    """Reads in flight by default: from a local disk, one band per core (at least two, so that
    one band is read while the one before is hashed and written); from an object store,
    ``REMOTE_READ_PARALLEL`` ranged GETs (latency-bound, not CPU-bound)."""
    return max(2, min(cores(), MOST_AT_ONCE)) if local else REMOTE_READ_PARALLEL


def default_files_at_once(local: bool = True) -> int:
    """Files written at once by default: to a local disk one per core (at least two: the kernel
    copies into one file under its inode's lock, so one file's bytes move on one core); to an
    object store ``REMOTE_FILES_AT_ONCE``."""
    return max(2, min(cores(), MOST_AT_ONCE)) if local else REMOTE_FILES_AT_ONCE


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """How remote stores are reached."""

    endpoint_url: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec storage options for remote URLs (``--storage-option key=value``)."""
    part_size: int = 8 << 20
    """Multipart upload part size (S3 minimum 5 MiB)."""
    upload_parallel: int = 8
    """Parts of one object in flight at once."""

    def fs_options(self, protocol: str) -> dict[str, Any]:
        if protocol in ("file", "local", "memory"):
            return {}
        options = dict(self.options)
        if protocol in ("s3", "s3a"):
            options.setdefault("config_kwargs", {"retries": dict(S3_RETRIES), **S3_TIMEOUTS})
            if self.endpoint_url:
                options["endpoint_url"] = self.endpoint_url
        return options


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    storage: StorageConfig = field(default_factory=StorageConfig)
    allow_incomplete: bool = False
    """Read checkpoints whose ckptctl job never finished (``--allow-incomplete``)."""
    hf_config: Mapping[str, Any] | None = None
    """The HF ``config.json`` of a DCP checkpoint holding an HF model (``--hf-config``)."""
    trusted_fields: frozenset[str] = frozenset()
    """Model-description fields the user vouches for (``--trust-field``): read past, although
    ckptctl does not know whether they change the model."""
    tag: str | None = None
    """The DeepSpeed tag directory to read instead of the one ``latest`` names (``--tag``)."""
    text_only: bool = False
    """Read the text decoder of an HF vision-language checkpoint alone, its vision tower left
    out (``--text-only``)."""
    allow_rounding: bool = False
    """Round weights HF stores shifted from Megatron's (Qwen3.5's gated norm) where the shift
    is not exact in their dtype, reading or writing, each tensor's largest error recorded
    (``--allow-rounding``)."""
    memory_budget: int = 1 << 30
    """Tensor data held in memory at once, in bytes."""
    checksum: str = "xxh3_64"
    """File checksum recorded in manifests: ``xxh3_64`` or ``sha256``."""
    stage_dir: str | None = None
    """Write outputs to this local directory first and upload them in the background."""
    read_parallel: int | None = None
    """Reads in flight (``--read-parallel``): bands built at once from a local disk, ranged GETs
    from an object store; ``None``: ``default_read_parallel`` for the source's storage."""
    files_at_once: int | None = None
    """Files of the target written at once (``--files-at-once``); ``None``:
    ``default_files_at_once`` for the target's storage."""
