"""Reading the text decoder of an HF vision-language checkpoint alone (``--text-only``): the
names its files hold, renamed to the text model's (``ckptctl.model.hf_text_backbone``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from ckptctl import json_input
from ckptctl.formats.safetensors_header import read_header
from ckptctl.io.storage import Storage
from ckptctl.model.hf_layout import INDEX, SINGLE
from ckptctl.model.hf_text_backbone import TextBackbone, text_backbone

T = TypeVar("T")


def read_backbone(storage: Storage, config: Mapping[str, Any], where: str) -> TextBackbone:
    """The decoder of the checkpoint in ``storage`` (config ``config``), by the names its
    index (or its one file's header) holds."""
    if storage.exists(INDEX):
        index = json_input.parse_object(storage.read_text(INDEX), storage.describe(INDEX))
        weight_map = json_input.field(
            index, "weight_map", dict, f"{storage.describe(INDEX)}: malformed index"
        )
        held: list[str] = list(weight_map)
    elif storage.exists(SINGLE):
        storage.path(SINGLE)
        with storage.open_read(SINGLE) as f:
            held = list(read_header(f, storage.describe(SINGLE), storage.size(SINGLE)).tensors)
    else:
        held = []
    return text_backbone(config, held, where)


def renamed(tensors: Mapping[str, T], backbone: TextBackbone | None) -> dict[str, T]:
    """``tensors`` (by stored name) by the text model's names, the decoder's only."""
    if backbone is None:
        return dict(tensors)
    return {backbone.renames[k]: v for k, v in tensors.items() if k in backbone.renames}
