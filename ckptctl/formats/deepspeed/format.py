"""DeepSpeed ZeRO checkpoints' registry entry (read only, for now)."""

from __future__ import annotations

from typing import Any

from ckptctl.formats.base import CheckpointFormat, ProbeRequest
from ckptctl.formats.deepspeed.layout import recognised
from ckptctl.formats.support import FormatSupport
from ckptctl.storage import Storage


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None or not recognised(names):
        return None
    from ckptctl.formats.deepspeed.reader import probe_deepspeed

    return probe_deepspeed(storage, names, request)


FORMAT = CheckpointFormat(
    "deepspeed",
    _probe,
    support=FormatSupport(
        "deepspeed",
        "DeepSpeed ZeRO stage 1/2 checkpoint (HF model)",
        "latest + <tag>/mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt",
        True,
        "",
        "ZeRO 1/2, any DP size, several parameter groups, frozen and tied parameters, fp32 "
        "masters and Adam moments; the model from config.json or --hf-config",
        "CRC-32 of every zip entry",
    ),
)
