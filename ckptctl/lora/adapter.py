"""A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), local
or at any URL, read-only: its config checked, its tensors' header parsed strictly, the A and B
matrices read on demand (an adapter is small next to its base)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ckptctl import arrays, json_input
from ckptctl.errors import CheckpointError, CheckpointNotFoundError
from ckptctl.formats.safetensors_header import SafetensorsHeader, read_header
from ckptctl.io.storage import Storage
from ckptctl.model.lora import (
    ADAPTER_CONFIG,
    LoraPair,
    Replacement,
    TokenRows,
    check_config,
    pairs,
    replacements,
    token_rows,
)
from ckptctl.model.peft_wrapped import adapter_config
from ckptctl.settings import StorageConfig

if TYPE_CHECKING:
    import torch

CONFIG = ADAPTER_CONFIG
WEIGHTS = "adapter_model.safetensors"
PICKLED = "adapter_model.bin"


class LoraSource:
    """An adapter as the merge reads it: the weights it changes and its matrices, whether
    from a PEFT adapter directory (``Adapter``) or trained inside a checkpoint
    (``ckptctl.lora.embedded``)."""

    pairs: dict[str, LoraPair]
    """By base weight name."""
    whole: dict[str, Replacement]
    """``modules_to_save``'s tensors, by the base tensor they replace."""
    tokens: dict[str, TokenRows]
    """Embedding rows trained beside the adapter, by the embedding's name."""
    fingerprint: str
    """xxh3-64 of the config and the weights: a merge's plan names the adapter by it."""

    @property
    def url(self) -> str:
        raise NotImplementedError

    def matrix(self, name: str) -> torch.Tensor:
        """Tensor ``name`` of the adapter, in float32."""
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 0)

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of tensor ``name`` (the whole of a 0-d one), in float32."""
        raise NotImplementedError


class HeldAdapter(LoraSource):
    """An adapter whose matrices ckptctl gathers itself from a training run's files (trained
    inside a checkpoint, or Megatron-Bridge's), held as PEFT would save them: ``--adapter-only``
    writes it out as an adapter directory."""

    settings: dict[str, Any]
    """The ``adapter_config.json`` PEFT would save for it."""
    dtypes: dict[str, str]
    """Each matrix's stored dtype, by its PEFT name."""

    def names(self) -> list[str]:
        """The matrices' PEFT names, sorted."""
        raise NotImplementedError

    def stored(self, name: str) -> np.ndarray:
        """Matrix ``name`` as the run stored it (its dtype)."""
        raise NotImplementedError

    def _describe(
        self,
        shapes: dict[str, tuple[int, ...]],
        alpha: float,
        architecture: str,
        base_model: str | None,
        where: str,
    ) -> None:
        """The config PEFT would save for matrices of ``shapes`` trained at ``alpha``, checked;
        the merge's terms; a fingerprint of the config and every stored matrix."""
        self.settings = adapter_config(shapes, alpha, architecture, base_model)
        check_config(self.settings, where, frozenset())
        self.pairs = pairs(self.settings, shapes, where)
        self.whole, self.tokens = {}, {}
        digest = xxhash.xxh3_64(json.dumps(self.settings, sort_keys=True).encode())
        for name in sorted(shapes):
            digest.update(name.encode())
            digest.update(self.stored(name).tobytes())
        self.fingerprint = digest.hexdigest()


@dataclass
class Adapter(LoraSource):
    storage: Storage
    header: SafetensorsHeader
    pairs: dict[str, LoraPair]
    whole: dict[str, Replacement]
    tokens: dict[str, TokenRows]
    fingerprint: str
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return self.storage.url

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header.tensors[name].shape)

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """A module trained whole may be as large as the base's, so it is read a band at a
        time."""
        entry = self.header.tensors[name]
        shape = entry.shape
        row = (entry.end - entry.begin) // max(shape[0], 1) if shape else entry.end - entry.begin
        start, count = (entry.begin + lo * row, (hi - lo) * row) if shape else (entry.begin, row)
        with self._lock:  # bands of several tensors are built on several threads
            data = self.storage.read_range(WEIGHTS, start, count)
        flat = np.frombuffer(data, arrays.numpy_dtype(entry.dtype))
        return arrays.to_torch(flat.reshape((hi - lo, *shape[1:]) if shape else ())).float()


def open_adapter(url: str, config: StorageConfig, trusted: frozenset[str]) -> Adapter:
    storage = Storage(url, config, read_only=True)
    if not storage.exists(CONFIG):
        raise CheckpointNotFoundError(
            f"{storage.describe(CONFIG)}: no such file; give the directory PEFT's "
            "save_pretrained wrote (adapter_config.json, adapter_model.safetensors)"
        )
    if not storage.exists(WEIGHTS):
        pickled = storage.exists(PICKLED)
        raise CheckpointNotFoundError(
            f"{storage.describe(WEIGHTS)}: no such file"
            + (
                f"; {PICKLED} is a pickle, which ckptctl does not load: save the adapter "
                "with safe_serialization=True"
                if pickled
                else ""
            )
        )
    text = storage.read_text(CONFIG)
    where = storage.describe(CONFIG)
    settings = json_input.parse_object(text, where)
    check_config(settings, where, trusted)
    size = storage.size(WEIGHTS)
    with storage.open_read(WEIGHTS) as f:
        header = read_header(f, storage.describe(WEIGHTS), size)
    shapes = {name: entry.shape for name, entry in header.tensors.items()}
    if not shapes:
        raise CheckpointError(f"{storage.describe(WEIGHTS)}: the adapter holds no tensors")
    found = pairs(settings, shapes, storage.describe(WEIGHTS))
    whole = replacements(settings, shapes)
    tokens = token_rows(settings, shapes, storage.describe(WEIGHTS))
    digest = xxhash.xxh3_64(text.encode())
    with storage.open_read(WEIGHTS) as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return Adapter(storage, header, found, whole, tokens, digest.hexdigest())
