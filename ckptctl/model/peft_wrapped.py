"""The state dict of a model trained *with* a PEFT LoRA adapter in it (``get_peft_model`` before
sharding, as verl does when ``lora_rank > 0``): its names split into the base model's (the
wrapper's prefix and ``base_layer`` taken off) and the adapter's (named as PEFT's
``save_pretrained`` names them: the adapter's own name taken off). Pure.

Anything else the wrapper may hold (modules trained whole, DoRA magnitudes, LoRA biases,
trainable tokens, a second adapter) is refused by name: the base or the adapter read without it
would be wrong."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import CheckpointError
from ckptctl.model.geometry import Shape
from ckptctl.model.lora import PREFIX
from ckptctl.model.stored import StoredFile

_BASE_LAYER = re.compile(r"(?P<module>.+)\.base_layer\.(?P<param>[^.]+)")
_LORA = re.compile(r"(?P<module>.+)\.(?P<part>lora_[AB])\.(?P<adapter>[^.]+)\.weight")
_EMBEDDING_LORA = re.compile(r"(?P<module>.+)\.(?P<part>lora_embedding_[AB])\.(?P<adapter>[^.]+)")
_OTHER_PEFT = re.compile(
    r"\.(?:modules_to_save|original_module|lora_magnitude_vector|lora_bias|token_adapter|"
    r"lora_[A-Za-z_]+)(?:\.|$)"
)


@dataclass(frozen=True, slots=True)
class PeftNames:
    """A wrapped state dict's names: each stored name's base name or adapter name."""

    base: dict[str, str]
    """Stored name -> the base model's own name (``model.layers.0.self_attn.q_proj.weight``)."""
    adapter: dict[str, str]
    """Stored name -> PEFT's saved name (``base_model.model.<module>.lora_A.weight``)."""
    adapter_name: str

    @property
    def modules(self) -> tuple[str, ...]:
        """The adapted modules, by their name in the base model."""
        found = {n[len(PREFIX) :].rsplit(".lora_", 1)[0] for n in self.adapter.values()}
        return tuple(sorted(found))


@dataclass(frozen=True, slots=True)
class TrainedWith:
    """What a training run wrote down about its adapter, and where."""

    rank: int | None
    alpha: float | None
    where: str


def trained_with(doc: dict[str, Any], where: str) -> TrainedWith:
    """verl's ``lora_train_meta.json`` (``{"r", "lora_alpha", "task_type"}``), checked."""

    def number(name: str) -> float | None:
        value = doc.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise CheckpointError(f"{where}: {name} is {value!r}, not a positive number")
        return float(value)

    rank = number("r")
    if rank is not None and not rank.is_integer():
        raise CheckpointError(f"{where}: r is {doc.get('r')!r}, not a whole number")
    return TrainedWith(None if rank is None else int(rank), number("lora_alpha"), where)


@dataclass(frozen=True, slots=True)
class EmbeddedLora:
    """A LoRA adapter a checkpoint holds beside its base model: its matrices' stored tensors
    (by PEFT's saved names) and what its ``adapter_config.json`` needs from the model."""

    files: tuple[StoredFile, ...]
    architecture: str
    base_model: str | None
    """The model's hub name or path as its config records it (``_name_or_path``)."""
    name: str
    """The adapter's name in the trained model (PEFT's ``default``)."""
    reader: object = None
    """What reads the matrices' boxes, when not the checkpoint holding the adapter (a DCP
    checkpoint whose metadata was unwrapped to the base model's names)."""
    trained: TrainedWith | None = None
    """The rank and alpha the run recorded beside the checkpoint (verl's
    ``lora_train_meta.json``), if it did."""
    alone: bool = False
    """Saved without its base's weights (verl's ``save_lora_only``)."""
    megatron: bool = False
    """The files hold Megatron-Bridge's adapter matrices by their ``torch_dist`` keys, the
    layers stacked (``decoder.layers.<module>.adapter.linear_in|linear_out.weight``), not
    PEFT's: ``ckptctl.lora.megatron`` names them for the model."""

    @property
    def modules(self) -> frozenset[str]:
        if self.megatron:  # each stacked key's module, on each of its layers
            return frozenset(
                f"{MEGATRON_LAYERS}{layer}.{_module(t.canonical)}"
                for f in self.files
                for t in f.tensors
                for p in t.pieces
                for layer in range(p.canonical[0], p.canonical[0] + p.sizes[0])
            )
        return frozenset(t.canonical.rsplit(".lora_", 1)[0] for f in self.files for t in f.tensors)


MEGATRON_LAYERS = "decoder.layers."


def _module(key: str) -> str:
    """The layer's module a stacked Megatron-Bridge adapter key is on."""
    return key.removeprefix(MEGATRON_LAYERS).split(".adapter.")[0]


def wrapped(names: Iterable[str]) -> bool:
    """Whether a state dict is a PEFT model's (every name under ``base_model.model.``)."""
    names = list(names)
    return bool(names) and all(n.startswith(PREFIX) for n in names)


def split(names: Iterable[str], where: str) -> PeftNames:
    """Each stored name placed in the base or in the adapter; what is neither is refused."""
    base: dict[str, str] = {}
    adapter: dict[str, str] = {}
    adapters: set[str] = set()
    for name in names:
        if not name.startswith(PREFIX):
            raise CheckpointError(f"{where}: {name} lies outside the PEFT model's {PREFIX}")
        local = name[len(PREFIX) :]
        if (layer := _BASE_LAYER.fullmatch(local)) is not None:
            base[name] = f"{layer['module']}.{layer['param']}"
        elif (lora := _LORA.fullmatch(local) or _EMBEDDING_LORA.fullmatch(local)) is not None:
            suffix = ".weight" if lora.re is _LORA else ""
            adapter[name] = f"{PREFIX}{lora['module']}.{lora['part']}{suffix}"
            adapters.add(lora["adapter"])
        elif _OTHER_PEFT.search(local) is not None:
            raise CheckpointError(
                f"{where}: {name}: a PEFT tensor other than LoRA's A and B matrices (modules "
                "trained whole, DoRA, LoRA biases, trainable tokens are not read from a "
                "training checkpoint); save the adapter with PEFT's save_pretrained and merge "
                "that"
            )
        else:
            base[name] = local
    if len(adapters) > 1:
        raise CheckpointError(
            f"{where}: the model holds LoRA adapters {sorted(adapters)}; ckptctl reads a "
            "checkpoint of one"
        )
    if not adapter:
        raise CheckpointError(f"{where}: a PEFT model's state dict without LoRA matrices")
    clashes = len(set(base.values())) != len(base)
    if clashes:
        raise CheckpointError(f"{where}: the PEFT model holds a base tensor twice")
    return PeftNames(base, adapter, adapters.pop())


def adapter_config(
    shapes: dict[str, Shape], alpha: float, architecture: str, base_model: str | None
) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT would save for these matrices (saved names -> shapes)
    trained at ``alpha``: the rank most modules have as ``r``, any other module's in
    ``rank_pattern`` (its exact name, escaped: PEFT reads the keys as patterns), the adapted
    modules by their full names as ``target_modules``."""
    ranks: dict[str, int] = {}
    for name, shape in shapes.items():
        module, _, part = name[len(PREFIX) :].rpartition(".lora_")
        if part in ("A.weight", "embedding_A") and shape:
            ranks[module] = int(shape[0])
    counts = Counter(ranks.values())
    r = max(sorted(counts), key=lambda rank: counts[rank]) if counts else 8
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if architecture.endswith("ForCausalLM") else None,
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "rank_pattern": {re.escape(m): k for m, k in sorted(ranks.items()) if k != r},
        "target_modules": sorted(ranks),
        "bias": "none",
        "use_rslora": False,
    }
