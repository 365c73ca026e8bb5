"""accelerate's full state dicts' registry entry (``save_state`` under FSDP with
``FULL_STATE_DICT``; the sharded form is DCP, read by the ``dcp`` format)."""

from __future__ import annotations

from typing import Any

from ckptctl.formats.accelerate.layout import MODEL, OPTIMIZER
from ckptctl.formats.base import CheckpointFormat, ProbeRequest
from ckptctl.formats.options import ALLOW_ROUNDING, HF_CONFIG, TRUSTED_FIELDS
from ckptctl.formats.support import FormatSupport
from ckptctl.io.storage import Storage


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None or MODEL not in names:
        return None
    from ckptctl.formats.accelerate.reader import probe_accelerate

    return probe_accelerate(storage, names, request)


FORMAT = CheckpointFormat(
    "accelerate",
    _probe,
    options=(HF_CONFIG, TRUSTED_FIELDS, ALLOW_ROUNDING),
    support=FormatSupport(
        "accelerate",
        "accelerate save_state under FSDP with FULL_STATE_DICT (HF model)",
        f"{MODEL} (+ {OPTIMIZER}); config.json beside it or --hf-config",
        True,
        "",
        "the whole model and Adam state by HF name; any architecture transformers builds to "
        "HF, the mapped families also to Megatron",
        "CRC-32 of every zip entry",
    ),
)
