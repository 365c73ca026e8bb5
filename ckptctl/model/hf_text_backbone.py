"""The language model inside an HF vision-language checkpoint (``--text-only``). Pure.

Qwen3.5 and Gemma 3 are released as vision-language models (``Qwen3_5ForConditionalGeneration``,
``Gemma3ForConditionalGeneration``): a text decoder of a family ckptctl maps (its config under
``text_config``), a vision tower and a projector. Megatron's GPT model holds the decoder only, so
the decoder is read alone when the user asks for it, never silently: the vision tensors are
left out, counted in the summary, and the output is the text model (``Qwen3_5ForCausalLM``,
``Gemma3ForCausalLM``), which transformers itself loads from such a checkpoint by the same
renaming.

Where the decoder's tensors are: transformers 5 saves ``model.language_model.*`` beside
``model.visual.*`` / ``model.vision_tower.*`` and ``lm_head.weight``; Gemma 3's releases (the
LLaVA layout transformers 4 wrote) keep ``language_model.model.*`` and
``language_model.lm_head.weight``. Whether the output layer is stored is the wrapper's
``tie_word_embeddings`` (transformers ties a vision-language model's head by its top-level
config), so that value is the text model's. Qwen3.5's releases keep the decoder's multi-token
prediction layer at the top (``mtp.*``, announced by ``text_config``'s
``mtp_num_hidden_layers``): it is the text model's, read with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import UsageError
from ckptctl.model.hf_config import has_family_table

TEXT_CONFIG = "text_config"
# (stored prefix, the text model's own), longest first
LAYOUTS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
)
MTP_HEAD, MTP_LAYERS = "mtp.", "mtp_num_hidden_layers"
CARRIED = ("tie_word_embeddings", "torch_dtype", "dtype")
"""Top-level fields of the wrapper that decide the text model's too."""


@dataclass(frozen=True)
class TextBackbone:
    """The text decoder of a vision-language checkpoint: its config and where its tensors are."""

    config: dict[str, Any]
    """The decoder's ``config.json``, as a ``*ForCausalLM`` of its family reads it."""
    wrapper: str
    """What holds it (the checkpoint's architecture or model type), for messages."""
    renames: dict[str, str]
    """Stored name -> the text model's name, for every decoder tensor held."""
    omitted: tuple[str, ...]
    """Stored names outside the decoder (vision tower, projector), left out."""

    def note(self) -> str:
        tops = sorted({name.split(".")[0] if not name.startswith("model.") else
                       ".".join(name.split(".")[:2]) for name in self.omitted})  # fmt: skip
        where = f" ({', '.join(f'{t}.*' for t in tops[:4])})" if tops else ""
        return (
            f"the text decoder of {self.wrapper} read alone (--text-only): "
            f"{len(self.omitted)} tensors outside it{where} left out"
        )


def is_multimodal(config: Mapping[str, Any]) -> bool:
    """A wrapper config holding its language model's config under ``text_config``."""
    return isinstance(config.get(TEXT_CONFIG), Mapping)


def text_backbone(config: Mapping[str, Any], held: Iterable[str], where: str) -> TextBackbone:
    """The decoder of the vision-language model ``config`` describes, whose checkpoint holds
    the tensors ``held``; refused (naming ``where``) if it is not one or its decoder's tensors
    are not where transformers puts them."""
    text = config.get(TEXT_CONFIG)
    if not isinstance(text, Mapping):
        raise UsageError(
            f"{where}: --text-only reads the text decoder of a vision-language model, but this "
            f"config has no {TEXT_CONFIG}",
            hint="drop --text-only: the checkpoint is a text model already",
        )
    names = sorted(held)
    layout = next(
        (rules for rules in LAYOUTS if any(n.startswith(rules[0][0]) for n in names)), None
    )
    if layout is None:
        raise UsageError(
            f"{where}: --text-only found no decoder tensors "
            f"({' or '.join(rules[0][0] + '*' for rules in LAYOUTS)})",
            hint="give the checkpoint of a vision-language model transformers saved",
        )
    renames: dict[str, str] = {}
    omitted = []
    if text.get(MTP_LAYERS):  # the decoder's MTP layer, kept under its own name
        layout = (*layout, (MTP_HEAD, MTP_HEAD))
    for name in names:
        prefix = next((p for p in layout if name.startswith(p[0])), None)
        if prefix is None:
            omitted.append(name)
        else:
            renames[name] = prefix[1] + name.removeprefix(prefix[0])
    decoder = dict(text) | {k: config[k] for k in CARRIED if k in config}
    architectures = config.get("architectures")
    wrapper = (
        architectures[0]
        if isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
        else str(config.get("model_type", "a vision-language model"))
    )
    return TextBackbone(decoder, wrapper, renames, tuple(omitted))


def text_only_hint(config: Mapping[str, Any]) -> str | None:
    """For a checkpoint no family table takes: its text decoder converts alone, if it has one
    of a family ckptctl maps."""
    text = config.get(TEXT_CONFIG)
    if is_multimodal(config) and isinstance(text, Mapping) and has_family_table(text):
        return (
            f"its text decoder ({text.get('model_type')}) converts alone with --text-only "
            "(the vision tower and projector left out; an MTP layer its config announces kept)"
        )
    return None
