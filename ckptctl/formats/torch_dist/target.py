"""Megatron-Core's ``torch_dist`` as a target: DCP files per rank, ``metadata.json``, the
tracker, then ``.metadata`` and ``common.pt`` (the writer's finish files). The distributed
optimizer's state as the source keeps it, or as ``--optim-sharding`` says. Pure."""

from __future__ import annotations

from ckptctl.formats.megatron_common.iterations import MCORE_METADATA
from ckptctl.formats.megatron_common.layout import (
    TRACKER,
    iteration_dir,
    tracker_text,
)
from ckptctl.formats.megatron_common.rank_state import carry_source_state
from ckptctl.formats.megatron_common.sharded_keys import MCORE_METADATA_TEXT, torch_dist_files
from ckptctl.formats.megatron_common.target import (
    megatron_notes,
    refuse_frozen,
    weight_dtype,
    writable,
)
from ckptctl.formats.megatron_common.target_style import target_optimizer
from ckptctl.formats.target import RESHARD, TargetFormat
from ckptctl.formats.torch_dist.dp_reshardable_targets import with_buckets
from ckptctl.formats.torch_dist.model_space import flattened_files
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import FileWrite, TextWrite
from ckptctl.model.stored import CheckpointView
from ckptctl.model.target import TargetFiles, TargetRequest

DCP_SHARD = "dcp-shard"
"""``FileWrite.kind`` of a ``.distcp`` file: one ``torch.save`` record per tensor chunk."""


class TorchDistTarget(TargetFormat):
    name = "torch_dist"
    operations = (RESHARD,)
    help = "Megatron-Core's DCP format"

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        spec = writable(source)
        style = request.style
        layout = request.layout or ParallelLayout(dp=source.layout.dp)
        dtype = weight_dtype(source, request)
        optimizer = target_optimizer(
            style.optimizer if source.has_optimizer else None, layout, dtype
        )
        refuse_frozen(source, source.has_optimizer and style.optimizer is not None)
        states: tuple[str, ...] = ("exp_avg", "exp_avg_sq") if source.has_optimizer else ()
        if states and (layout.distributed_optimizer or dtype != "float32"):
            # fp32 masters apart from the weights: the distributed optimizer's, and the
            # mixed-precision wrapper's (Megatron's FP32Optimizer trains the weights themselves)
            states = ("fp32_param", *states)
        base = iteration_dir(source.iteration)
        # The distributed optimizer's state as its grad-buffer buckets (dp_reshardable), or
        # per parameter (fully_reshardable, or N-D flattened: fully_sharded_model_space): the
        # source's form unless --optim-sharding says.
        buckets = bool(states) and layout.distributed_optimizer
        buckets = buckets and optimizer is not None and optimizer.buckets
        per_parameter = () if buckets else states
        targets = torch_dist_files(spec, layout, base, dtype, per_parameter, style.naming)
        if buckets and optimizer is not None:
            targets = with_buckets(
                targets, spec, layout, optimizer, dtype, style.naming, style.expert_naming
            )
        elif states and layout.distributed_optimizer and optimizer and optimizer.model_space:
            targets = flattened_files(targets, spec, layout.tp)
        notes, warnings = megatron_notes(source, layout, legacy=False)
        return TargetFiles(
            files=targets,
            kind=DCP_SHARD,
            layout=layout,
            reason="Megatron-Core torch_dist: DCP files per rank, optimizer and training state "
            "kept",
            # metadata.json is what Megatron checks for completeness: after .metadata, common.pt.
            finalize=(
                TextWrite(path=f"{base}/{MCORE_METADATA}", content=MCORE_METADATA_TEXT),
                TextWrite(path=TRACKER, content=tracker_text(source.iteration)),
            ),
            carries_rank_state=True,
            optimizer_carried=bool(states),
            notes=notes,
            warnings=warnings,
        )

    def with_source_state(
        self, source: CheckpointView, files: tuple[FileWrite, ...], layout: ParallelLayout
    ) -> tuple[tuple[FileWrite, ...], int]:
        return carry_source_state(source, files, layout, dcp=True)
