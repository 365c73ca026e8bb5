"""A LoRA adapter trained inside a checkpoint (a PEFT model's state dict, as verl saves its
actor when trained with LoRA): its matrices gathered from the checkpoint's shards (an adapter is
small next to its base), its ``adapter_config.json`` rebuilt from their names and shapes and
the alpha the user gives (a state dict does not hold it). ``merge-lora`` merges it like an
adapter directory, or writes it out as one (``--adapter-only``)."""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

import numpy as np

from ckptctl import arrays
from ckptctl.errors import LayoutError
from ckptctl.formats.base import Checkpoint
from ckptctl.formats.hf.writer import write_safetensors
from ckptctl.io.storage import Storage
from ckptctl.lora.adapter import CONFIG, WEIGHTS, HeldAdapter
from ckptctl.model.peft_wrapped import EmbeddedLora
from ckptctl.model.stored import StoredTensor

if TYPE_CHECKING:
    import torch


class EmbeddedAdapter(HeldAdapter):
    """The adapter ``ckpt.adapter`` holds, trained at ``alpha`` (``settings``: the config
    PEFT would save for it)."""

    def __init__(self, ckpt: Checkpoint, url: str, alpha: float) -> None:
        if ckpt.adapter is None:
            raise LayoutError(f"{url}: holds no LoRA adapter")
        reader = ckpt.adapter.reader
        self.ckpt: Checkpoint = reader if isinstance(reader, Checkpoint) else ckpt
        self._url = url
        self._parts = held_parts(ckpt.adapter)
        self._shapes = {name: _global_shape(parts) for name, parts in self._parts.items()}
        self.dtypes = {name: parts[0][1].dtype for name, parts in self._parts.items()}
        self._lock = threading.Lock()
        self._stored: dict[str, np.ndarray] = {}
        self._describe(
            self._shapes,
            alpha,
            ckpt.adapter.architecture,
            ckpt.adapter.base_model,
            f"{url} (its LoRA adapter)",
        )
        trained = ckpt.adapter.trained
        if trained is not None and trained.rank not in (None, self.settings["r"]):
            raise LayoutError(
                f"{trained.where}: r is {trained.rank}, but the adapter's matrices are of rank "
                f"{self.settings['r']}: the file is not this run's"
            )

    @property
    def url(self) -> str:
        return self._url

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return arrays.to_torch(self.stored(name)[lo:hi]).float()

    def stored(self, name: str) -> np.ndarray:
        """Tensor ``name`` as the checkpoint stores it (its dtype), gathered from its shards."""
        with self._lock:
            kept = self._stored.get(name)
        if kept is not None:
            return kept
        out = gathered(self.ckpt, self._parts[name], name, self._url)
        with self._lock:
            self._stored[name] = out
        return out


def held_parts(adapter: EmbeddedLora) -> dict[str, list[tuple[str, StoredTensor]]]:
    """Each of the adapter's tensors: the files and stored tensors holding its pieces."""
    out: dict[str, list[tuple[str, StoredTensor]]] = {}
    for file in adapter.files:
        for t in file.tensors:
            out.setdefault(t.canonical, []).append((file.path, t))
    return out


def gathered(
    ckpt: Checkpoint, parts: list[tuple[str, StoredTensor]], name: str, url: str
) -> np.ndarray:
    """Tensor ``name`` whole as ``ckpt`` stores it (its dtype), from its pieces in ``parts``;
    refused unless they tile it, every element once."""
    out = np.zeros(_global_shape(parts), arrays.numpy_dtype(parts[0][1].dtype))
    filled = 0
    for path, t in parts:
        data = ckpt.read(path, t.key, (0,) * len(t.shape), t.shape)
        for piece in t.pieces:
            source = tuple(slice(a, a + n) for a, n in zip(piece.local, piece.sizes, strict=True))
            target = tuple(
                slice(a, a + n) for a, n in zip(piece.canonical, piece.sizes, strict=True)
            )
            out[target] = data[source]
            filled += piece.numel
    if filled != out.size:
        raise LayoutError(f"{url}: {name}'s shards hold {filled} of {out.size} values")
    return out


def _global_shape(parts: list[tuple[str, StoredTensor]]) -> tuple[int, ...]:
    """The tensor's shape: where its pieces end, furthest."""
    ends = [
        tuple(a + n for a, n in zip(p.canonical, p.sizes, strict=True))
        for _, t in parts
        for p in t.pieces
    ]
    return tuple(max(e[d] for e in ends) for d in range(len(ends[0]))) if ends else ()


def write_adapter(adapter: HeldAdapter, out: Storage) -> int:
    """PEFT's adapter directory: the matrices as stored (their dtype, PEFT's saved names),
    then ``adapter_config.json`` last (what marks the directory an adapter). Bytes written."""
    names = adapter.names()
    entries = [(n, adapter.dtypes[n], adapter.shape(n)) for n in names]
    with out.open_write(WEIGHTS) as f:
        write_safetensors(f, entries, lambda i: [adapter.stored(names[i]).tobytes()])
    text = json.dumps(adapter.settings, indent=2, sort_keys=True) + "\n"
    out.write_text(CONFIG, text)
    return sum(adapter.stored(n).nbytes for n in names) + len(text)
