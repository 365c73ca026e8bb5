"""``--text-only`` for DCP: a vision-language model trained under FSDP (saved in transformers'
in-memory names, ``model.language_model.*`` beside ``model.vision_tower.*`` / ``model.visual.*``
and ``lm_head.weight``) read as its text decoder. The metadata is renamed, as a state dict of
the text model would name it (its Adam state too); the vision tower's and projector's tensors
and their optimizer state are left out and counted. Which names are the decoder's is
``ckptctl.model.hf_text_backbone``'s rule, the one the HF reader follows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptctl.errors import UsageError
from ckptctl.formats.dcp_container.metadata import DcpMetadata, TensorEntry
from ckptctl.model.hf_text_backbone import LAYOUTS, text_backbone

EMBEDDING = "embed_tokens.weight"
STATES = ("exp_avg", "exp_avg_sq", "step")


def _prefix(keys: list[str], suffix: str) -> str | None:
    """The shortest saver's prefix under which a key ends with a decoder's embedding (as
    transformers lays a vision-language model out) followed by ``suffix``."""
    found = [
        key[: -len(decoder + EMBEDDING + suffix)]
        for key in keys
        for (decoder, _), _ in LAYOUTS
        if key.endswith(decoder + EMBEDDING + suffix)
    ]
    return min(found, key=len) if found else None


def text_decoder(
    metadata: DcpMetadata, config: dict[str, Any], where: str
) -> tuple[DcpMetadata, dict[str, Any], str]:
    """``metadata`` renamed to the text decoder's names (the rest left out), the decoder's
    ``config.json``, and a note saying what was left out."""
    keys = [k for k, e in metadata.entries.items() if isinstance(e, TensorEntry)]
    model = _prefix(keys, "")
    if model is None:
        raise UsageError(
            f"{where}: --text-only found no vision-language model's decoder in this DCP "
            "checkpoint (no key ends with model.language_model.embed_tokens.weight)",
            hint="drop --text-only: the checkpoint is a text model's, or not an HF model's",
        )
    optim = _prefix(keys, ".exp_avg")
    held = [k[len(model) :] for k in keys if k.startswith(model) and not _is_state(k, optim)]
    backbone = text_backbone(config, held, where)
    renamed = {model + stored: model + own for stored, own in backbone.renames.items()}
    dropped = {model + stored for stored in backbone.omitted}
    if optim is not None:
        for stored, own in backbone.renames.items():
            for state in STATES:
                renamed[f"{optim}{stored}.{state}"] = f"{optim}{own}.{state}"
        dropped |= {f"{optim}{stored}.{state}" for stored in backbone.omitted for state in STATES}
        groups = optim.removesuffix("state.") + "param_groups."  # torch's per-parameter options
        for fqn in metadata.entries:
            param, _, option = fqn.removeprefix(groups).rpartition(".")
            if not fqn.startswith(groups):
                continue
            if param in backbone.renames:
                renamed[fqn] = f"{groups}{backbone.renames[param]}.{option}"
            elif param in backbone.omitted:
                dropped.add(fqn)
    entries = {
        renamed.get(fqn, fqn): entry
        for fqn, entry in metadata.entries.items()
        if fqn not in dropped
    }
    storage = {
        (renamed.get(fqn, fqn), offsets): info
        for (fqn, offsets), info in metadata.storage.items()
        if fqn not in dropped
    }
    paths = None
    if metadata.planner_data is not None:  # each item's place in the saved state dict
        names = backbone.renames
        paths = {
            renamed.get(fqn, fqn): tuple(names.get(p, p) if isinstance(p, str) else p for p in path)
            for fqn, path in metadata.planner_data.items()
            if fqn not in dropped
        }
    text = replace(metadata, entries=entries, storage=storage, planner_data=paths)
    return text, backbone.config, backbone.note()


def _is_state(key: str, optim: str | None) -> bool:
    return optim is not None and key.startswith(optim) and key.rsplit(".", 1)[-1] in STATES
