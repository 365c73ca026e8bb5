"""A DCP checkpoint of a model trained with its PEFT LoRA adapter in it (accelerate's
``save_state`` of a ``get_peft_model`` model under FSDP: ``model.base_model.model.<...>``):
its metadata seen as the base model's (the wrapper's names unwrapped, the LoRA matrices and
their optimizer state set apart), and the adapter as ``EmbeddedLora`` read from the original
records. Everything else of the checkpoint is read as any DCP checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ckptctl.formats.dcp_container.files import chunks_placed, files_of
from ckptctl.formats.dcp_container.metadata import DcpMetadata, StorageInfo, TensorEntry
from ckptctl.model.lora import PREFIX
from ckptctl.model.peft_wrapped import EmbeddedLora, PeftNames, split
from ckptctl.model.stored import StoredTensor


@dataclass(frozen=True)
class Unwrapped:
    metadata: DcpMetadata
    """The base model's: its keys under the names the unwrapped model has."""
    adapter: list[tuple[StorageInfo, StoredTensor]]
    """The LoRA matrices' chunks (keys of the original metadata), by PEFT's saved names."""
    names: PeftNames
    dropped_state: int
    """Optimizer-state tensors of the wrapped model's names (the adapter's) left out."""


def _outer(keys: list[str]) -> str | None:
    """The prefix before PEFT's ``base_model.model.`` that the model keys share (``model.``
    for accelerate's ``{"model": state_dict}``); ``None``: not a PEFT model's checkpoint."""
    found = {k[: k.index(PREFIX)] for k in keys if PREFIX in k and ".lora_" in k}
    outer = [p for p in found if not p.startswith("optim")]
    return outer[0] if len(outer) == 1 else None


def unwrap(metadata: DcpMetadata, where: str) -> Unwrapped | None:
    keys = [k for k, e in metadata.entries.items() if isinstance(e, TensorEntry)]
    outer = _outer(keys)
    if outer is None:
        return None
    wrapped = outer + PREFIX
    names = split((k[len(outer) :] for k in keys if k.startswith(wrapped)), where)
    renamed: dict[str, str] = {outer + n: outer + b for n, b in names.base.items()}
    entries: dict[str, Any] = {}
    dropped = 0
    for fqn, entry in metadata.entries.items():
        if fqn in renamed:
            entries[renamed[fqn]] = entry
        elif fqn[len(outer) :] in names.adapter and fqn.startswith(outer):
            continue
        elif PREFIX in fqn:  # the adapter's optimizer state (the base was frozen)
            dropped += 1
        else:
            entries[fqn] = entry
    storage = {}
    for (fqn, offsets), info in metadata.storage.items():
        if fqn in renamed:
            storage[(renamed[fqn], offsets)] = info
        elif fqn in entries:
            storage[(fqn, offsets)] = info
    adapter: list[tuple[StorageInfo, StoredTensor]] = []
    for stored, saved in names.adapter.items():
        entry = metadata.entries[outer + stored]
        assert isinstance(entry, TensorEntry)
        adapter += chunks_placed(metadata, outer + stored, entry, saved)
    unwrapped = replace(metadata, entries=entries, storage=storage, planner_data=None)
    return Unwrapped(unwrapped, adapter, names, dropped)


def embedded(
    found: Unwrapped, base: str, config: dict[str, Any] | None, reader: object
) -> EmbeddedLora:
    architectures = (config or {}).get("architectures") or ["unknown"]
    base_model = (config or {}).get("_name_or_path")
    return EmbeddedLora(
        files_of(base, found.adapter),
        str(architectures[0]),
        base_model if isinstance(base_model, str) and base_model else None,
        found.names.adapter_name,
        reader,
    )
