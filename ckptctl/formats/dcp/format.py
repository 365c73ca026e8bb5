"""The PyTorch Distributed Checkpoint format's registry entry (any DCP checkpoint but
Megatron-Core's ``torch_dist``, which has its own)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptctl.errors import UsageError
from ckptctl.formats.base import CheckpointFormat, ProbeRequest
from ckptctl.formats.dcp_container.checksums import description_files, record_checksums
from ckptctl.formats.megatron_common.options import ITERATION
from ckptctl.formats.options import ALLOW_ROUNDING, HF_CONFIG, TEXT_ONLY, TRUSTED_FIELDS
from ckptctl.formats.support import FormatSupport
from ckptctl.io.storage import Storage


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None:
        return None
    from ckptctl.formats.dcp_container.files import (
        accelerate_parts,
        locate,
        read_merged_metadata,
        read_metadata,
    )
    from ckptctl.formats.hf_state_dict_files import trainer_step

    given = request.get(HF_CONFIG)
    config = dict(given) if given is not None else None
    parts = accelerate_parts(storage, names)
    if parts:  # accelerate's save_state / the HF Trainer's checkpoint-N under FSDP
        metadata = read_merged_metadata(storage, parts)
        base, step = "", trainer_step(storage)
    else:
        found = locate(storage, names, request.get(ITERATION))
        if found is None:
            return None
        (base, step), metadata = found, read_metadata(storage, found[0])
    if not request.get(TEXT_ONLY):
        return _with_adapter(storage, base, step, config, request, metadata)
    from ckptctl.formats.dcp.reader import _config_beside
    from ckptctl.formats.dcp.text_only import text_decoder

    where = storage.describe(base or ".")
    wrapper = config if config is not None else _config_beside(storage, base)
    if wrapper is None:
        raise UsageError(
            f"{where}: --text-only needs the vision-language model's config.json",
            hint="put it beside the checkpoint or give it with --hf-config",
        )
    metadata, config, note = text_decoder(metadata, wrapper, where)
    ckpt = _with_adapter(storage, base, step, config, request, metadata)
    ckpt.view = replace(ckpt.view, notes=(*ckpt.view.notes, note))
    return ckpt


def _with_adapter(
    storage: Storage,
    base: str,
    step: int | None,
    config: dict[str, Any] | None,
    request: ProbeRequest,
    metadata: Any,
) -> Any:
    """The checkpoint, and a LoRA adapter trained in it (a PEFT model's names: the base
    model is read from the unwrapped names, the adapter beside it)."""
    from ckptctl.formats.dcp.peft import embedded, unwrap
    from ckptctl.formats.dcp.reader import _config_beside, probe_dcp
    from ckptctl.formats.dcp_container.checkpoint import open_dcp

    found = unwrap(metadata, storage.describe(base or "."))
    trusted, rounding = request.get(TRUSTED_FIELDS), request.get(ALLOW_ROUNDING)
    if found is None:
        return probe_dcp(storage, base, step, config, trusted, metadata, rounding)
    ckpt = probe_dcp(storage, base, step, config, trusted, found.metadata, rounding)
    config = config if config is not None else _config_beside(storage, base)
    ckpt.adapter = embedded(found, base, config, open_dcp(storage, base, metadata))
    modules = len(found.names.modules)
    note = f"trained with LoRA adapter {found.names.adapter_name!r} on {modules} modules"
    if found.dropped_state:
        note += f" (its optimizer state, {found.dropped_state} tensors, not read)"
    ckpt.view = replace(ckpt.view, notes=(*ckpt.view.notes, note))
    return ckpt


FORMAT = CheckpointFormat(
    "dcp",
    _probe,
    options=(ITERATION, HF_CONFIG, TRUSTED_FIELDS, TEXT_ONLY, ALLOW_ROUNDING),
    support=FormatSupport(
        "dcp",
        "PyTorch Distributed Checkpoint (torchtitan, FSDP2, DTensor, accelerate save_state)",
        ".metadata, __R_N.distcp (accelerate: pytorch_model_fsdp_0/ + optimizer_0/)",
        True,
        "",
        "any DCP state dict to one torch file; HF models (config.json beside or --hf-config): "
        "any architecture transformers builds to HF by name, the mapped families also to "
        "Megatron or torch_dist with their Adam state",
        "CRC-32 of every tensor record",
    ),
    description_files=description_files,
    integrity=record_checksums,
)
