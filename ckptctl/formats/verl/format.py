"""verl's FSDP checkpoints' registry entry: read (they become HF, Megatron, ...), and written
at another world size by ``reshard`` (a resume on more or fewer GPUs)."""

from __future__ import annotations

from typing import Any

from ckptctl.formats.base import CheckpointFormat, ProbeRequest, lazy
from ckptctl.formats.options import ALLOW_ROUNDING, HF_CONFIG, TRUSTED_FIELDS
from ckptctl.formats.support import FormatSupport
from ckptctl.formats.verl.layout import recognised
from ckptctl.formats.verl.target import VERL_FILE, VerlTarget
from ckptctl.io.storage import Storage


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None or not recognised(names):
        return None
    from ckptctl.formats.verl.reader import probe_verl

    return probe_verl(storage, names, request)


FORMAT = CheckpointFormat(
    "verl",
    _probe,
    options=(HF_CONFIG, TRUSTED_FIELDS, ALLOW_ROUNDING),
    support=FormatSupport(
        "verl",
        "verl FSDP2 actor / critic checkpoint (HF model; verl's Megatron actor: torch_dist)",
        "model_world_size_W_rank_R.pt (+ optim_*, extra_state_*), fsdp_config.json, "
        "huggingface/config.json",
        True,
        "reshard (--dp: another world size)",
        "any world size, FSDP2 or HSDP (written with its shard groups kept); DTensor shards "
        "placed as their placements say; Adam state by "
        "parameter; the model from huggingface/config.json or --hf-config (any architecture "
        "transformers builds to HF, the mapped families also to Megatron)",
        "CRC-32 of every zip entry",
    ),
    target=VerlTarget(),
    writers={VERL_FILE: lazy("ckptctl.formats.verl.writer", "write_verl_file")},
)
