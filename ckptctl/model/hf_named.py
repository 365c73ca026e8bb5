"""An HF model ckptctl knows by its tensor names only: any architecture transformers builds,
described by transformers itself (``ckptctl.formats.transformers_model``), carried from a
source that holds HF parameter names (FSDP / DCP training, safetensors) to HF safetensors by
name, with no family table. Pure.

What is written is what ``save_pretrained`` would write: each tensor under its hub name
(transformers 5 renames some in memory, e.g. a VLM's ``model.language_model.*`` is the hub's
``model.*``), one tensor of each tied group, the source's ``config.json`` and
``generation_config.json`` as they were.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ckptctl.model.geometry import Shape

GENERATION_CONFIG = "generation_config.json"

_FLOATING = frozenset({"float64", "float32", "bfloat16", "float16"})


@dataclass(frozen=True, slots=True)
class HfNamedModel:
    """Names and shapes of an HF model as transformers builds it from its ``config.json``."""

    architecture: str
    tensors: tuple[tuple[str, Shape], ...]
    """Every tensor of the model's ``state_dict()`` (names as transformers holds them in
    memory), in its order."""
    hub_names: tuple[tuple[str, str], ...] = ()
    """In-memory name -> the name ``save_pretrained`` writes, where the two differ by a
    renaming only (the bytes are the same)."""
    converted: tuple[str, ...] = ()
    """In-memory tensors ``save_pretrained`` would convert (e.g. split packed experts) in a way
    ckptctl does not repeat: written under their in-memory names, which transformers 5 loads."""
    tied: tuple[tuple[str, str], ...] = ()
    """(alias, kept): tensors that share one parameter; ``save_pretrained`` writes ``kept``."""
    parameters: tuple[str, ...] = ()
    """The model's parameters in ``named_parameters()`` order (tied ones once): the order an
    optimizer built from ``model.parameters()`` numbers them."""
    hub_converted: tuple[tuple[str, Shape], ...] = ()
    """What ``save_pretrained`` writes for the ``converted`` tensors (names, shapes): an HF
    checkpoint holds either these or the in-memory tensors."""

    def hub_name(self, name: str) -> str:
        return dict(self.hub_names).get(name, name)

    def shapes(self) -> dict[str, Shape]:
        return dict(self.tensors)


@dataclass(frozen=True, slots=True)
class HfNamedSource:
    """What an HF-named source carries besides its tensors: its config files, as text."""

    model: HfNamedModel
    config: str
    """The source's ``config.json``."""
    generation_config: str | None = None

    def config_for(self, dtype: str | None) -> str:
        """``config.json`` as written: the source's, with its dtype fields set to ``dtype``
        when the weights are converted."""
        if dtype is None:
            return self.config
        doc = json.loads(self.config)
        for key in ("torch_dtype", "dtype"):
            if key in doc or key == "dtype":
                doc[key] = dtype
        for sub in ("text_config", "vision_config"):
            inner = doc.get(sub)
            if isinstance(inner, dict):
                for key in ("torch_dtype", "dtype"):
                    if key in inner:
                        inner[key] = dtype
        return json.dumps(doc, indent=2)


def converts(dtype: str) -> bool:
    """Whether ``--dtype`` converts a tensor of ``dtype`` (floating weights; never integer
    buffers such as position ids)."""
    return dtype in _FLOATING
