"""DeepSpeed ZeRO checkpoints' registry entry: read ZeRO 1/2/3, write universal checkpoints."""

from __future__ import annotations

from typing import Any

from ckptctl.formats.base import CheckpointFormat, ProbeRequest, lazy
from ckptctl.formats.deepspeed.layout import recognised, recognised_universal
from ckptctl.formats.deepspeed.options import TAG
from ckptctl.formats.deepspeed.target import DEEPSPEED_UNIVERSAL, UniversalTarget
from ckptctl.formats.options import HF_CONFIG, TRUSTED_FIELDS
from ckptctl.formats.support import FormatSupport
from ckptctl.io.storage import Storage


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None or not recognised(names):
        return None
    from ckptctl.formats.deepspeed.reader import probe_deepspeed

    return probe_deepspeed(storage, names, request)


FORMAT = CheckpointFormat(
    "deepspeed",
    _probe,
    options=(TAG, HF_CONFIG, TRUSTED_FIELDS),
    support=FormatSupport(
        "deepspeed",
        "DeepSpeed ZeRO stage 1/2/3 checkpoint (HF model)",
        "latest + <tag>/[zero_pp_rank_*_]mp_rank_00_model_states.pt, *_optim_states.pt",
        True,
        "",
        "ZeRO 1/2/3, fp32 and bf16, any DP size, several parameter groups, frozen and tied "
        "parameters, fp32 masters and Adam moments; --tag; the model from config.json or "
        "--hf-config",
        "CRC-32 of every zip entry",
    ),
)


def _probe_universal(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None or not recognised_universal(names):
        return None
    from ckptctl.formats.deepspeed.universal import probe_universal

    return probe_universal(storage, names, request)


UNIVERSAL = CheckpointFormat(
    "deepspeed-universal",
    _probe_universal,
    options=(TAG, TRUSTED_FIELDS),
    support=FormatSupport(
        "deepspeed-universal",
        "DeepSpeed universal checkpoint (HF model)",
        "latest_universal + <tag>/zero/<parameter>/fp32.pt",
        True,
        "consolidate --format deepspeed-universal (from every format with an HF model)",
        "fp32 weights, Adam moments and step per parameter, parameter groups; DeepSpeed "
        "loads it at any DP size with load_universal_checkpoint",
        "CRC-32 of every zip entry",
    ),
    target=UniversalTarget(),
    writers={DEEPSPEED_UNIVERSAL: lazy("ckptctl.formats.deepspeed.writer", "write_universal_file")},
)
FORMATS = (UNIVERSAL, FORMAT)  # a universal tag directory holds model states too
