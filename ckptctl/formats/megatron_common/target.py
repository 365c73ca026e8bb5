"""Megatron-LM legacy checkpoints as a target: one ``model_optim_rng.pt`` per (tp, pp, ep) rank
(``distrib_optim.pt`` beside it under the distributed optimizer), the tracker file written last.
Also what every Megatron-family target (legacy and ``torch_dist``) says and refuses alike. Pure."""

from __future__ import annotations

from ckptctl.errors import UsageError
from ckptctl.formats.megatron_common.layout import (
    TRACKER,
    megatron_files,
    tracker_text,
)
from ckptctl.formats.megatron_common.mla_args import mla_args
from ckptctl.formats.megatron_common.rank_state import carry_source_state, same_rank_grid
from ckptctl.formats.megatron_common.target_style import target_optimizer
from ckptctl.formats.target import CONSOLIDATE, RESHARD, TargetFormat, known_model
from ckptctl.model.catalog import is_state
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import OptimizerLayout
from ckptctl.model.plan import FileWrite, TextWrite
from ckptctl.model.rope_scaling import megatron_args as rope_megatron_args
from ckptctl.model.stored import CheckpointView, Format
from ckptctl.model.target import TargetFiles, TargetRequest

MEGATRON_RANK = "megatron-rank"
"""``FileWrite.kind`` of a ``model_optim_rng.pt`` rank file."""
DISTRIBUTED_OPTIMIZER = "distrib-optim"
"""``FileWrite.kind`` of a ``distrib_optim.pt`` file (flat buffers)."""


def writable(source: CheckpointView) -> ModelSpec:
    """The source's model, refused before anything is written where Megatron-LM's arguments
    cannot build it."""
    spec = known_model(source, "megatron")
    mla_args(spec.mla)
    rope_megatron_args(spec.rope_scaling)
    return spec


def weight_dtype(source: CheckpointView, request: TargetRequest) -> str:
    """The dtype the target's weights are written in: the asked one, else the source's."""
    weight = next(t for f in source.files for t in f.tensors if not is_state(t.canonical))
    return request.dtype or weight.dtype


def megatron_notes(
    source: CheckpointView, layout: ParallelLayout, *, legacy: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a Megatron-family target cannot keep as it was, said the same way by every
    operation that writes one: notes, warnings."""
    notes, warnings = [], []
    spec = known_model(source, "megatron")
    old, new = spec.padded_vocab_size(source.layout.tp), spec.padded_vocab_size(layout.tp)
    if source.format in (Format.MEGATRON, Format.TORCH_DIST) and old != new:
        notes.append(
            f"vocabulary padding recomputed for tp={layout.tp}: {old} -> {new} rows; "
            "padding rows of embedding, output layer and their optimizer state are zeros"
        )
    same_grid = same_rank_grid(source.layout, layout)
    if source.format == Format.MEGATRON and legacy and not same_grid:
        warnings.append(
            "RNG state belongs to each rank's place in the TP/PP/EP grid, which changes: "
            "dropped, as Megatron-LM does when it reshards; resume with --no-load-rng"
        )
    return tuple(notes), tuple(warnings)


def refuse_frozen(source: CheckpointView, carries_optimizer: bool) -> None:
    """Frozen parameters (DeepSpeed) have no Adam state, and Megatron's optimizers hold every
    parameter: refuse rather than invent state for them."""
    if source.frozen and carries_optimizer:
        raise UsageError(
            f"frozen parameters ({', '.join(source.frozen[:3])}) have no Adam state, but "
            "Megatron's optimizer holds every parameter: consolidate --format torch or "
            "deepspeed-universal keeps the trained parameters' state, --format hf the weights"
        )


def not_carried(source: CheckpointView, target: str) -> str:
    return (
        f"the {source.format} source's optimizer state is not carried to {target} yet: the "
        "target holds weights only"
    )


def refuse_stages_without_experts(
    spec: ModelSpec, layout: ParallelLayout, optimizer: OptimizerLayout
) -> None:
    """Under expert parallelism megatron-core chains a dense and an expert optimizer and (from
    0.15) gives every rank the parameter groups of every rank, so a pipeline stage without MoE
    layers (a dense-first model's first stage) keeps an expert optimizer of empty groups:
    written so with per-parameter state. Its ``DistributedOptimizer`` cannot save that stage
    in the legacy format (``state_dict`` finds no step in the empty expert optimizer): no such
    checkpoint exists to resume from, so none is written."""
    if layout.ep <= 1 or not spec.is_moe or not optimizer.distributed:
        return
    stages: dict[int, bool] = {}
    for (stage, _), layers in layout.chunk_layers(spec.num_layers).items():
        stages[stage] = stages.get(stage, False) or any(spec.is_moe_layer(i) for i in layers)
    if spec.mtp_num_layers:
        stages[layout.pp - 1] = True  # the MTP block rides on the last stage
    bare = sorted(s for s, has in stages.items() if not has)
    if bare:
        raise UsageError(
            f"EP{layout.ep} with the distributed optimizer: pipeline stage(s) {bare} hold no MoE "
            "layer, and megatron-core's DistributedOptimizer cannot save such a stage in the "
            "legacy format (its empty expert optimizer has no step); give "
            "--no-distributed-optimizer, a stage split that puts a MoE layer on every stage "
            "(--pp-first-stage-layers), or --format torch_dist"
        )


class MegatronTarget(TargetFormat):
    name = "megatron"
    operations = (CONSOLIDATE, RESHARD)
    help = "legacy mp_rank_* files with optimizer and training state"

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        spec = writable(source)
        style = request.style
        consolidating = request.layout is None
        if request.layout is None:  # one full checkpoint, still one rank per data-parallel copy
            layout = ParallelLayout(dp=source.layout.dp)
            kept = style.optimizer
        else:
            layout = request.layout
            kept = style.optimizer if source.has_optimizer else None
        refuse_frozen(source, kept is not None)
        dtype = weight_dtype(source, request)
        optimizer = target_optimizer(kept, layout, dtype)
        if optimizer is not None:
            refuse_stages_without_experts(spec, layout, optimizer)
        targets = megatron_files(
            spec,
            layout,
            iteration=source.iteration,
            weight_dtype=dtype,
            optimizer=optimizer,
            naming=style.naming,
            layer_order=style.layer_order,
            expert_naming=style.expert_naming,
            mtp_inner=style.mtp_inner,
        )
        notes, warnings = megatron_notes(source, layout, legacy=True)
        if consolidating and source.has_optimizer and optimizer is None:
            warnings += (not_carried(source, self.name),)
        return TargetFiles(
            files=targets,
            kind=MEGATRON_RANK,
            flat_kind=DISTRIBUTED_OPTIMIZER,
            layout=layout,
            reason="Megatron TP1 PP1: every tensor merged, optimizer and training state kept",
            finalize=(TextWrite(path=TRACKER, content=tracker_text(source.iteration)),),
            carries_rank_state=True,
            optimizer_carried=optimizer is not None,
            notes=notes,
            warnings=warnings,
        )

    def with_source_state(
        self, source: CheckpointView, files: tuple[FileWrite, ...], layout: ParallelLayout
    ) -> tuple[tuple[FileWrite, ...], int]:
        return carry_source_state(source, files, layout, dcp=False)

    def stored_as_is(self, source: CheckpointView) -> tuple[TextWrite, ...] | None:
        if source.format != Format.MEGATRON:
            return None
        return (TextWrite(path=TRACKER, content=tracker_text(source.iteration)),)
