"""The PyTorch Distributed Checkpoint format's registry entry (any DCP checkpoint but
Megatron-Core's ``torch_dist``, which has its own)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptctl.checksums.integrity import ZIP_MAGIC, Targets, whole_file_entries, zip_entries
from ckptctl.errors import UsageError
from ckptctl.formats.base import CheckpointFormat, ProbeRequest
from ckptctl.formats.dcp.metadata import METADATA_FILE
from ckptctl.formats.support import FormatSupport
from ckptctl.formats.torch_dist.layout import COMMON, MCORE_METADATA
from ckptctl.io.storage import Storage
from ckptctl.model.stored import CheckpointView


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None:
        return None
    from ckptctl.formats.dcp.files import (
        accelerate_parts,
        locate,
        read_merged_metadata,
        read_metadata,
    )
    from ckptctl.formats.hf_state_dict_files import trainer_step

    config = dict(request.hf_config) if request.hf_config is not None else None
    parts = accelerate_parts(storage, names)
    if parts:  # accelerate's save_state / the HF Trainer's checkpoint-N under FSDP
        metadata = read_merged_metadata(storage, parts)
        base, step = "", trainer_step(storage)
    else:
        found = locate(storage, names, request.iteration)
        if found is None:
            return None
        (base, step), metadata = found, read_metadata(storage, found[0])
    if not request.text_only:
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
    from ckptctl.formats.dcp.reader import _config_beside, open_dcp, probe_dcp

    found = unwrap(metadata, storage.describe(base or "."))
    trusted, rounding = request.trusted_fields, request.allow_rounding
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


def description_files(storage: Storage, view: CheckpointView) -> list[str]:
    """``.metadata`` (and Megatron-Core's ``common.pt`` and ``metadata.json``)."""
    if not view.files:
        return []
    base = view.files[0].path.rpartition("/")[0]
    candidates = [f"{base}/{n}" if base else n for n in (METADATA_FILE, COMMON, MCORE_METADATA)]
    return [c for c in candidates if storage.exists(c)]


def record_checksums(ckpt: Any) -> Targets:
    """The CRC-32 of every ``torch.save`` record inside the ``.distcp`` files, and of
    ``common.pt``; pickled byte records carry none."""
    from ckptctl.formats.dcp.records import RecordWindow

    storage = ckpt.storage
    targets = Targets()
    plain = 0
    by_file: dict[str, list] = {}
    for key, info in ckpt.metadata.storage.items():
        rel = f"{ckpt.base}/{info.relative_path}" if ckpt.base else info.relative_path
        by_file.setdefault(rel, []).append((key, info))
    for rel, records in sorted(by_file.items()):
        entries = targets.zips.setdefault(rel, [])
        with storage.open_read(rel) as f:
            for key, info in sorted(records, key=lambda r: r[1].offset):
                window = RecordWindow(f, info.offset, info.length)
                if info.transform_descriptors or window.read(4) != ZIP_MAGIC:
                    plain += 1  # pickled bytes, or a record written without torch.save
                    continue
                window.seek(0)
                fqn = key[0] if isinstance(key, tuple) else key
                where = f"{storage.describe(rel)}@{info.offset}"
                entries += zip_entries(window, where, info.offset, f"record {fqn}")
    common = f"{ckpt.base}/{COMMON}" if ckpt.base else COMMON
    if storage.exists(common):
        targets.zips[common] = whole_file_entries(storage, common)
    if plain:
        targets.unchecked.append(f"{plain} DCP records store no checksum (pickled bytes)")
    return targets


FORMAT = CheckpointFormat(
    "dcp",
    _probe,
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
