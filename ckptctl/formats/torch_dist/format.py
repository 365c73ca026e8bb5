"""Megatron-Core's ``torch_dist`` format's registry entry: DCP files in a Megatron iteration
directory, with ``metadata.json`` naming the backend and ``common.pt`` holding ``args`` (or
files beside it describing the run: Megatron-Bridge's ``run_config.yaml``, verl's Megatron
actor's ``huggingface/`` and ``transformer_config.json``)."""

from __future__ import annotations

from typing import Any

from ckptctl.formats.base import CheckpointFormat, ProbeRequest, lazy
from ckptctl.formats.dcp_container.checksums import description_files, record_checksums
from ckptctl.formats.megatron_common.options import ITERATION, TRUE_VOCAB_SIZE
from ckptctl.formats.options import HF_CONFIG, TRUSTED_FIELDS
from ckptctl.formats.support import FormatSupport
from ckptctl.formats.torch_dist.target import DCP_SHARD, TorchDistTarget
from ckptctl.io.storage import Storage


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None:
        return None
    from ckptctl.formats.dcp_container.files import locate
    from ckptctl.formats.megatron_common.iterations import mcore_backend
    from ckptctl.formats.torch_dist import verl_actor, verl_split
    from ckptctl.formats.torch_dist.reader import probe_torch_dist

    if verl_split.recognised(names):
        return verl_split.probe_split(storage, request)
    if verl_actor.recognised(names):
        return verl_actor.probe_verl_actor(storage, request)
    found = locate(storage, names, request.get(ITERATION))
    if found is None or mcore_backend(storage, found[0]) != "torch_dist":
        return None
    return probe_torch_dist(
        storage, found[0], found[1], request.get(TRUE_VOCAB_SIZE), request.get(TRUSTED_FIELDS)
    )


WRITER = "ckptctl.formats.torch_dist.writer"

FORMAT = CheckpointFormat(
    "torch_dist",
    _probe,
    options=(ITERATION, TRUE_VOCAB_SIZE, TRUSTED_FIELDS, HF_CONFIG),
    support=FormatSupport(
        "torch_dist",
        "Megatron-Core distributed checkpoint (DCP-based; Megatron-LM's, Megatron-Bridge's, "
        "verl's Megatron actor)",
        "metadata.json (sharded_backend torch_dist), .metadata, *.distcp, common.pt (args), or "
        "Megatron-Bridge's run_config.yaml beside them; verl: dist_ckpt/ + huggingface/ + "
        "transformer_config.json, or verl 0.9's ckpt_contents.json naming model/ and optimizer/",
        True,
        "reshard --format torch_dist",
        "layer-stacked keys, fully_reshardable, dp_reshardable and fully_sharded_model_space "
        "optimizer state; Megatron-Bridge's runs read from their provider's fields",
        "CRC-32 of every tensor record",
    ),
    target=TorchDistTarget(),
    writers={DCP_SHARD: lazy(WRITER, "write_dcp_shard")},
    finish=lazy(WRITER, "torch_dist_directory_files"),
    finish_paths=lazy(WRITER, "torch_dist_directory_names"),
    description_files=description_files,
    integrity=record_checksums,
)
