"""Plan ``consolidate``: a sharded checkpoint into one full, topology-free checkpoint."""

from __future__ import annotations

import json

from ckptctl.errors import UsageError
from ckptctl.formats.megatron.layout import (
    TRACKER,
    MegatronStyle,
    megatron_files,
    target_optimizer,
    tracker_text,
)
from ckptctl.model.catalog import is_state, state_name
from ckptctl.model.geometry import Piece, Shape, whole
from ckptctl.model.hf_families import hf_config
from ckptctl.model.hf_layout import (
    CONFIG,
    INDEX,
    MODEL_KEY,
    OPTIMIZER_KEY,
    hf_files,
    hf_tensors,
    index_text,
)
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import FileKind, Plan, TextWrite
from ckptctl.model.stored import CheckpointView, Format, StoredFile, StoredTensor, canonical_shapes
from planners.convert import (
    from_source,
    megatron_rank_files,
    megatron_target_notes,
    plan_files,
    refuse_frozen,
)


def _is_weight(canonical: str) -> bool:
    return not is_state(canonical)


STATE_DICT_FILE = "state_dict.pt"
"""Name of the one file ``--format torch`` writes (read back by ``formats.torch_file``)."""


def plan_state_dict(
    source: CheckpointView, *, source_url: str, source_fingerprint: str, target_url: str
) -> Plan:
    """One ``torch.save`` file of every tensor, whole, at its stored key (what torch's
    ``dcp_to_torch_save`` writes, without holding the model in memory)."""
    tensors = tuple(
        StoredTensor((name,), name, shape, dtype, (whole(shape),))
        for name, (shape, dtype) in sorted(canonical_shapes(source).items())
    )
    return _torch_file_plan(
        source,
        StoredFile(STATE_DICT_FILE, tensors),
        "one torch.save file: every tensor whole at its key path, other items as stored",
        (source_url, source_fingerprint, target_url),
    )


def _torch_file_plan(
    source: CheckpointView, target: StoredFile, reason: str, urls: tuple[str, str, str]
) -> Plan:
    """A plan writing the one ``torch.save`` file ``target`` (urls: source, its fingerprint,
    target)."""
    source_url, source_fingerprint, target_url = urls
    files, estimates = plan_files(source, (target,), FileKind.TORCH_SAVE)
    return Plan(
        operation="consolidate",
        strategy="merge",
        reason=reason,
        **from_source(source, source_url, source_fingerprint),
        target_url=target_url,
        target_format=Format.TORCH,
        target_layout=ParallelLayout(),
        files=files,
        finalize=(),
        estimates=estimates,
        notes=source.notes,
        warnings=source.warnings,
    )


def named_weights(source: CheckpointView) -> list[tuple[str, str, Shape, tuple[Piece, ...]]]:
    """(name, canonical, shape, pieces) of every weight: HF names cut from the canonical
    tensors, or, for a model ckptctl does not know (a DeepSpeed run without ``config.json``),
    the canonical tensors themselves, whole, under the names the source gives them."""
    if source.spec is not None:
        return hf_tensors(source.spec)
    out: list[tuple[str, str, Shape, tuple[Piece, ...]]] = []
    for name, (shape, _) in canonical_shapes(source).items():
        if _is_weight(name):
            out.append((name, name, shape, (whole(shape),)))
    return out


def hf_state_dict_tensors(source: CheckpointView, dtype: str | None = None) -> StoredFile:
    """The tensors of an HF model's torch state dict: every weight at ``model.<HF name>``
    (``dtype`` converts weights only) and, for trained parameters, Adam's moments at
    ``optimizer.state.<HF name>``, each cut from the canonical tensors like the safetensors."""
    dtypes = source.canonical_dtypes()
    frozen = set(source.frozen)
    tensors = []
    for hf, canonical, shape, pieces in named_weights(source):
        weight_dtype = dtype or dtypes[canonical]
        tensors.append(StoredTensor((MODEL_KEY, hf), canonical, shape, weight_dtype, pieces))
        if not source.has_optimizer or canonical in frozen:
            continue
        for state in ("exp_avg", "exp_avg_sq"):
            name = state_name(state, canonical)
            key = (OPTIMIZER_KEY, "state", hf, state)
            tensors.append(StoredTensor(key, name, shape, dtypes[name], pieces))
    return StoredFile(STATE_DICT_FILE, tuple(tensors))


def plan_hf_state_dict(
    source: CheckpointView,
    *,
    source_url: str,
    source_fingerprint: str,
    target_url: str,
    dtype: str | None = None,
) -> Plan:
    """One ``torch.save`` file of an HF model's weights and Adam state (see
    ``hf_state_dict_tensors``); the source adds Adam's step and the parameter groups."""
    return _torch_file_plan(
        source,
        hf_state_dict_tensors(source, dtype),
        "one torch.save file: HF-named weights and per-parameter Adam state",
        (source_url, source_fingerprint, target_url),
    )


def plan_consolidate(
    source: CheckpointView,
    *,
    source_url: str,
    source_fingerprint: str,
    target_url: str,
    target_format: Format,
    style: MegatronStyle,
    dtype: str | None = None,
    max_shard_bytes: int = 5 << 30,
) -> Plan:
    """One full checkpoint: HF safetensors (weights) or a TP1/PP1 Megatron checkpoint (weights,
    optimizer and training state). ``dtype`` converts weights only; optimizer state stays fp32."""
    if source.spec is None:
        raise UsageError(
            f"the source's model family is unknown (keys are not Megatron-Core's or HF Llama's): "
            f"it cannot become {target_format.value}; consolidate it with --format torch"
            + "".join(f" ({n})" for n in source.notes if "--hf-config" in n)
        )
    dtypes = source.canonical_dtypes()
    notes, warnings = list(source.notes), list(source.warnings)
    if target_format == Format.HF:
        weight_dtypes = {
            hf: dtype or dtypes[canonical] for hf, canonical, _, _ in hf_tensors(source.spec)
        }
        targets = hf_files(source.spec, weight_dtypes, max_shard_bytes)
        files, estimates = plan_files(source, targets, FileKind.SAFETENSORS)
        out_dtype = dtype or next(iter(weight_dtypes.values()))
        finalize = []
        if len(targets) > 1:
            finalize.append(TextWrite(path=INDEX, content=index_text(targets)))
        finalize.append(
            TextWrite(path=CONFIG, content=json.dumps(hf_config(source.spec, out_dtype), indent=2))
        )
        if source.has_optimizer:
            notes.append("HF safetensors hold weights only: optimizer state is not written")
        layout = ParallelLayout()
        reason = "HF safetensors: full tensors, q/k/v and gate/up split out, vocabulary trimmed"
    else:
        layout = ParallelLayout(dp=source.layout.dp)
        refuse_frozen(source, style.optimizer is not None, "Megatron")
        some = next(t for f in source.files for t in f.tensors if _is_weight(t.canonical))
        weight_dtype = dtype or some.dtype
        targets = megatron_files(
            source.spec,
            layout,
            iteration=source.iteration,
            weight_dtype=weight_dtype,
            optimizer=target_optimizer(style.optimizer, layout, weight_dtype),
            naming=style.naming,
            layer_order=style.layer_order,
            expert_naming=style.expert_naming,
        )
        files, estimates = plan_files(source, targets, FileKind.MEGATRON_RANK, carry_from=0)
        files, read = megatron_rank_files(source, files, layout)
        estimates = estimates.model_copy(update={"bytes_read": estimates.bytes_read + read})
        finalize = [TextWrite(path=TRACKER, content=tracker_text(source.iteration))]
        more_notes, more_warnings = megatron_target_notes(source, layout, target_format)
        notes += more_notes
        warnings += more_warnings
        if source.has_optimizer and style.optimizer is None:
            warnings.append(
                f"the {source.format} source's optimizer state is not carried to "
                f"{target_format.value} yet: the target holds weights only"
            )
        reason = "Megatron TP1 PP1: every tensor merged, optimizer and training state kept"
    return Plan(
        operation="consolidate",
        strategy="merge",
        reason=reason,
        **from_source(source, source_url, source_fingerprint),
        target_url=target_url,
        target_format=target_format,
        target_layout=layout,
        files=files,
        finalize=tuple(finalize),
        estimates=estimates,
        notes=tuple(notes),
        warnings=tuple(warnings),
    )
