"""Plan ``reshard``: any Megatron layout (or a full checkpoint) into another Megatron layout.

Shard to shard: each target rank file is filled from exactly the source boxes that overlap it,
so no full model is ever assembled and no intermediate full checkpoint is written. A full source
(HF safetensors, or TP1 PP1 Megatron) is the same computation with one source shard.
"""

from __future__ import annotations

from ckptctl.errors import UsageError
from ckptctl.formats.megatron.layout import (
    TRACKER,
    MegatronStyle,
    OptimizerLayout,
    iteration_dir,
    megatron_files,
    target_optimizer,
    tracker_text,
)
from ckptctl.formats.torch_dist.dp_reshardable_targets import with_buckets
from ckptctl.formats.torch_dist.layout import (
    MCORE_METADATA,
    MCORE_METADATA_TEXT,
    torch_dist_files,
)
from ckptctl.formats.torch_dist.model_space import flattened_files
from ckptctl.model.catalog import is_state
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import FileKind, Plan, TextWrite
from ckptctl.model.stored import CheckpointView, Format
from planners.convert import (
    from_source,
    megatron_rank_files,
    megatron_target_notes,
    plan_files,
    refuse_frozen,
)


def plan_reshard(
    source: CheckpointView,
    target_layout: ParallelLayout,
    *,
    source_url: str,
    source_fingerprint: str,
    target_url: str,
    style: MegatronStyle,
    dtype: str | None = None,
    target_format: Format = Format.MEGATRON,
) -> Plan:
    spec = source.spec
    if spec is None:
        raise UsageError(
            "the source's model family is unknown (not Megatron-Core or HF Llama keys): it can "
            "only be consolidated with --format torch"
            + "".join(f" ({n})" for n in source.notes if "--hf-config" in n)
        )
    target_layout.check_against(spec)
    weight = next(t for f in source.files for t in f.tensors if not is_state(t.canonical))
    weight_dtype = dtype or weight.dtype
    optimizer = target_optimizer(
        style.optimizer if source.has_optimizer else None, target_layout, weight_dtype
    )
    refuse_frozen(source, source.has_optimizer and style.optimizer is not None, "Megatron")
    finalize = [TextWrite(path=TRACKER, content=tracker_text(source.iteration))]
    if target_format == Format.TORCH_DIST:
        states: tuple[str, ...] = ("exp_avg", "exp_avg_sq") if source.has_optimizer else ()
        if states and (target_layout.distributed_optimizer or weight_dtype != "float32"):
            # fp32 masters apart from the weights: the distributed optimizer's, and the
            # mixed-precision wrapper's (Megatron's FP32Optimizer trains the weights themselves)
            states = ("fp32_param", *states)
        base = iteration_dir(source.iteration)
        # The distributed optimizer's state as its grad-buffer buckets (dp_reshardable), or
        # per parameter (fully_reshardable, or N-D flattened: fully_sharded_model_space): the
        # source's form unless --optim-sharding says.
        buckets = bool(states) and target_layout.distributed_optimizer
        buckets = buckets and optimizer is not None and optimizer.buckets
        per_parameter = () if buckets else states
        targets = torch_dist_files(
            spec, target_layout, base, weight_dtype, per_parameter, style.naming
        )
        if buckets and optimizer is not None:
            targets = with_buckets(
                targets,
                spec,
                target_layout,
                optimizer,
                weight_dtype,
                style.naming,
                style.expert_naming,
            )
        elif states and target_layout.distributed_optimizer and optimizer and optimizer.model_space:
            targets = flattened_files(targets, spec, target_layout.tp)
        files, estimates = plan_files(source, targets, FileKind.DCP_SHARD, carry_from=0)
        files, read = megatron_rank_files(source, files, target_layout)
        estimates = estimates.model_copy(update={"bytes_read": estimates.bytes_read + read})
        # metadata.json is what Megatron checks for completeness: after .metadata, common.pt.
        finalize.insert(0, TextWrite(path=f"{base}/{MCORE_METADATA}", content=MCORE_METADATA_TEXT))
        optimizer = OptimizerLayout() if states else None
    elif target_format == Format.MEGATRON:
        targets = megatron_files(
            spec,
            target_layout,
            iteration=source.iteration,
            weight_dtype=weight_dtype,
            optimizer=optimizer,
            naming=style.naming,
            layer_order=style.layer_order,
            expert_naming=style.expert_naming,
        )
        files, estimates = plan_files(source, targets, FileKind.MEGATRON_RANK, carry_from=0)
        files, read = megatron_rank_files(source, files, target_layout)
        estimates = estimates.model_copy(update={"bytes_read": estimates.bytes_read + read})
    else:
        raise UsageError(f"reshard --format {target_format.value}: choose megatron or torch_dist")
    notes, warnings = megatron_target_notes(source, target_layout, target_format)
    notes, warnings = [*source.notes, *notes], [*source.warnings, *warnings]
    if optimizer is None and source.has_optimizer:
        warnings.append(
            f"the {source.format} source's optimizer state is not carried to "
            f"{target_format.value} yet: the target holds weights only"
        )
    elif optimizer is None:
        notes.append("no optimizer state in the source: the target holds weights only")
    is_full = not source.layout.is_sharded
    return Plan(
        operation="reshard",
        strategy="full-then-split" if is_full else "shard-to-shard",
        reason=(
            f"cut the full checkpoint for {target_layout.describe()}"
            if is_full
            else f"{source.layout.describe()} -> {target_layout.describe()}: each target shard "
            "assembled from the overlapping byte ranges of the source shards"
        ),
        **from_source(source, source_url, source_fingerprint),
        target_url=target_url,
        target_format=target_format,
        target_layout=target_layout,
        files=files,
        finalize=tuple(finalize),
        estimates=estimates,
        notes=tuple(notes),
        warnings=tuple(warnings),
    )
