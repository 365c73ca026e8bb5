"""Probe PyTorch Distributed Checkpoints: what model their keys hold, and how to read it.

``.metadata`` is parsed by the allow-listing unpickler of ``dcp_container.parse``; each tensor
chunk is a ``torch.save`` record at ``(file, offset, length)``, opened lazily and read by byte
range (exact ranged GETs on object stores). What the chunks hold:

* ``torch_dist`` (``metadata.json`` says so; training state in ``common.pt``): read by the
  ``torch_dist`` format, which builds on the same container reader (``dcp_container``).
* any other DCP checkpoint (torchtitan, FSDP2, ...): the model family is unknown, so each key is
  its own canonical tensor; it consolidates into a single torch file.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptctl import json_input
from ckptctl.errors import CheckpointError, LayoutError, UsageError
from ckptctl.formats.dcp.hf_named import hf_named_view
from ckptctl.formats.dcp.titan_layout import is_titan
from ckptctl.formats.dcp.titan_reader import titan_view
from ckptctl.formats.dcp_container.checkpoint import DcpCheckpoint, generic
from ckptctl.formats.dcp_container.files import files_of, join, read_metadata
from ckptctl.formats.dcp_container.metadata import DcpMetadata, TensorEntry
from ckptctl.formats.megatron_common.iterations import MCORE_METADATA, mcore_backend
from ckptctl.io.storage import Storage
from ckptctl.model.hf_config import has_family_table, spec_from_config
from ckptctl.model.hf_layout import CONFIG
from ckptctl.model.hf_named import GENERATION_CONFIG, HfNamedModel, HfNamedSource
from ckptctl.model.hf_state_dict import dcp_entries, prefixes
from ckptctl.model.hf_text_backbone import text_only_hint
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.stored import (
    CheckpointView,
    Format,
)

if TYPE_CHECKING:
    pass


def probe_dcp(
    storage: Storage,
    base: str,
    iteration: int | None,
    hf_config: dict[str, Any] | None = None,
    trusted: frozenset[str] = frozenset(),
    metadata: DcpMetadata | None = None,
    allow_rounding: bool = False,
) -> DcpCheckpoint:
    """Any DCP checkpoint but Megatron-Core's (``torch_dist`` has its own format);
    ``metadata``: already read (several DCP directories of one state dict);
    ``allow_rounding``: a shifted weight whose shift is not taken off exactly is rounded."""
    if metadata is None:
        metadata = read_metadata(storage, base)
    backend = mcore_backend(storage, base)
    if backend is not None:
        raise CheckpointError(
            f"{storage.describe(join(base, MCORE_METADATA))}: sharded_backend {backend!r} is "
            "not supported (torch_dist is)"
        )
    keys = [k for k, e in metadata.entries.items() if isinstance(e, TensorEntry)]
    found = prefixes(keys)
    config = hf_config if hf_config is not None else _config_beside(storage, base)
    if is_titan(keys):
        return _titan(storage, base, metadata, iteration, config, trusted)
    if config is not None:
        try:
            spec = spec_from_config(config, trusted=trusted)
            dcp_entries(spec)  # a model the family table cannot lay out is refused here
        except LayoutError as err:
            # No family table takes it (a VLM, a family ckptctl does not map to Megatron):
            # transformers judges the names, which go to HF as they are.
            why = f"not convertible to Megatron layouts: {err}"
            hint = text_only_hint(config)
            if hint is not None:  # a vision-language model whose decoder ckptctl maps
                why += f"; {hint}"
            from ckptctl.formats.transformers_model import build_names

            refusal = LayoutError(f"the model's config.json: {err}")
            try:
                model = build_names(config, storage.describe(join(base, CONFIG)))
                named = _any_hf_model(storage, base, metadata, iteration, config, model, why)
            except (CheckpointError, UsageError):
                if found is not None and has_family_table(config):
                    raise refusal from None  # its table's refusal names the field
                if found is not None:
                    raise
                named = None  # keys that are no HF model's: the config is not about them
            if named is not None:
                return named
            if found is not None:
                raise refusal from None
        if found is not None:
            where = storage.describe(base)
            view = hf_named_view(where, base, metadata, iteration, spec, found)
            return DcpCheckpoint(storage, view, base, metadata, rounding=allow_rounding)
    if found is None:
        return generic(storage, base, metadata, iteration)
    ckpt = generic(storage, base, metadata, iteration)
    ckpt.view = replace(
        ckpt.view,
        notes=(
            *ckpt.view.notes,
            "keys are an HF Llama model's: give its config.json with --hf-config to "
            "convert it to HF safetensors or Megatron",
        ),
    )
    return ckpt


def _config_beside(storage: Storage, base: str) -> dict[str, Any] | None:
    """An HF ``config.json`` saved next to the checkpoint (or one directory up)."""
    for rel in (join(base, CONFIG), CONFIG):
        if storage.exists(rel):
            return json_input.parse_object(storage.read_text(rel), storage.describe(rel))
    return None


def _any_hf_model(
    storage: Storage,
    base: str,
    metadata: DcpMetadata,
    iteration: int | None,
    config: dict[str, Any],
    model: HfNamedModel,
    why: str,
) -> DcpCheckpoint | None:
    """An HF model of any architecture transformers builds, its tensors by name (``None``:
    the checkpoint holds none of the model's names)."""
    from ckptctl.formats.dcp.hf_passthrough import model_prefix, named_tensors

    keys = [k for k, e in metadata.entries.items() if isinstance(e, TensorEntry)]
    if model_prefix(keys, model) is None:
        return None
    named = named_tensors(metadata, model, base)
    if named.problems:
        shown = "; ".join(named.problems[:5])
        more = len(named.problems) - 5
        raise CheckpointError(
            f"{storage.describe(base)}: {shown}" + (f" and {more} more" if more > 0 else "")
        )
    generation = join(base, GENERATION_CONFIG)
    carried = HfNamedSource(
        model,
        json.dumps(config, indent=2),
        storage.read_text(generation) if storage.exists(generation) else None,
    )
    view = CheckpointView(
        Format.DCP,
        None,
        ParallelLayout(),
        files_of(base, named.placed),
        iteration,
        named.has_optimizer,
        (*named.notes, why),
        replicas=named.replicas,
        hf_named=carried,
    )
    return DcpCheckpoint(storage, view, base, metadata)


def _titan(
    storage: Storage,
    base: str,
    metadata: DcpMetadata,
    iteration: int | None,
    config: dict[str, Any] | None,
    trusted: frozenset[str],
) -> DcpCheckpoint:
    """torchtitan's checkpoint: with the model's HF config, its tensors placed in the
    canonical ones; without, key by key. Its ``train_state.step`` is the iteration."""
    ckpt = generic(storage, base, metadata, iteration)
    if "train_state.step" in metadata.entries:
        step = ckpt.byte_item("train_state.step")[0]
        ckpt.view = replace(ckpt.view, iteration=step if isinstance(step, int) else iteration)
    if config is None:
        hint = "torchtitan checkpoint: give the model's HF config.json with --hf-config"
        ckpt.view = replace(ckpt.view, notes=(*ckpt.view.notes, f"{hint} to convert it to HF"))
        return ckpt
    spec = spec_from_config(config, trusted=trusted)
    where = storage.describe(base)
    view, rows = titan_view(where, base, metadata, ckpt.view.iteration, spec, ckpt.read)
    return DcpCheckpoint(storage, view, base, metadata, row_orders=rows)
