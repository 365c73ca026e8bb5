"""Megatron-Bridge's LoRA adapter saved in a ``torch_dist`` checkpoint beside its base (verl's
Megatron LoRA run under ``use_dist_checkpointing``): Megatron-Bridge's ``AdapterWrapper``
keeps the wrapped layer's keys as they were and adds each adapter's matrices under
``<layer key>.adapter.linear_in|linear_out``, its layers stacked like every per-layer key. Held
apart from the base as an ``EmbeddedLora`` by those keys, whose global tensors are the whole
matrices (each TP shard placed by Megatron-Bridge's own sharding, gate and up apart as for the
base's ``linear_fc1``): ``ckptctl.lora.megatron`` names them for the model. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.errors import CheckpointError
from ckptctl.model.hf_families import choose_family
from ckptctl.model.layout import ModelSpec
from ckptctl.model.peft_wrapped import EmbeddedLora
from ckptctl.model.stored import StoredFile

BRIDGE_ADAPTER = ".adapter.linear_"
"""What every key of a Megatron-Bridge LoRA matrix holds (its ``extra_state`` too)."""


@dataclass(frozen=True)
class BridgeLora:
    adapter: EmbeddedLora
    notes: tuple[str, ...]


def bridge_lora(files: tuple[StoredFile, ...], spec: ModelSpec, where: str) -> BridgeLora:
    """The adapter the ``torch_dist`` records of ``files`` hold (``where``: the directory)."""
    names = {t.canonical for f in files for t in f.tensors}
    if not names:
        raise CheckpointError(
            f"{where}: saved by a LoRA run (backend.peft), but holds no Megatron-Bridge adapter "
            f"(no *{BRIDGE_ADAPTER}in|out.weight): its weights are not the trained model's"
        )
    experts = sorted(n for n in names if ".experts." in n)
    if experts:
        raise CheckpointError(
            f"{experts[0]}: Megatron-Bridge's LoRA on MoE experts in a torch_dist checkpoint, "
            "which ckptctl does not read yet"
        )
    adapter = EmbeddedLora(files, choose_family(spec).architecture, None, "default", megatron=True)
    kinds = sorted({n.split(BRIDGE_ADAPTER)[0].rsplit(".", 1)[-1] for n in names})
    note = (
        f"trained with Megatron-Bridge's LoRA on {len(adapter.modules)} modules "
        f"({', '.join(kinds)} of each layer): the base's weights read apart from the adapter "
        "(its optimizer state not read)"
    )
    return BridgeLora(adapter, (note,))
