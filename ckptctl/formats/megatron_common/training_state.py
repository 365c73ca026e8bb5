"""What a Megatron target file (a legacy rank file, ``torch_dist``'s common state) keeps
besides tensors: ``args``, the counters and scheduler carried from the source, and the optimizer's
parameter-group settings, or fresh ones for a source that is no Megatron run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptctl.formats.base import Checkpoint, SavedTraining, WriteJob, adam_step
from ckptctl.formats.megatron_common.args import args_for, args_from_spec
from ckptctl.formats.torchsave.archive import TensorRef
from ckptctl.formats.torchsave.zip_writer import TensorSlot
from ckptctl.model.plan import FileWrite


def group_template(
    templates: dict[bool, dict[str, Any]], kind: bool, experts: bool
) -> dict[str, Any]:
    """A parameter group's settings; the expert optimizer's groups are the dense ones marked
    as expert-parallel (megatron-core records it in the group when it records it at all).
    A source that is no Megatron run (torch's Adam under FSDP: one group for every parameter)
    has no ``wd_mult`` / ``lr_mult``: each group gets Megatron's own for its kind (1 and 0 for
    weight decay, 1 for the learning rate, as ``_get_param_groups`` sets them), which keep the
    source's ``weight_decay`` and say which group is which (both groups otherwise read alike,
    and a stage whose first parameter takes none cannot be told apart)."""
    group = dict(templates[kind])
    if "wd_mult" not in group:
        group["wd_mult"] = 0.0 if kind else 1.0
        group.setdefault("lr_mult", 1.0)
    if experts and "is_expert_parallel" in group:
        group["is_expert_parallel"] = True
    return group


@dataclass
class TrainingState:
    """What a target file carries besides tensors: args, counters, scheduler, group settings."""

    owner: Any
    template_path: str
    carried: Any
    args: Any
    templates: dict[bool, dict[str, Any]]
    optimizer_step: float | None
    refs: list[TensorRef]
    """Tensors inside the carried state, copied as they are (slots ``carried<i>``)."""

    def carried_slots(self) -> list[TensorSlot]:
        return [TensorSlot(f"carried{i}", r.dtype, r.shape) for i, r in enumerate(self.refs)]

    def carried_bytes(self, slot: TensorSlot) -> memoryview:
        ref = self.refs[int(slot.key.removeprefix("carried"))]
        from ckptctl.arrays import raw_bytes  # numpy: only when bytes are handled

        return raw_bytes(self.owner.read_ref(self.template_path, ref))


def training_state(job: WriteJob, file: FileWrite) -> TrainingState:
    """What a Megatron target file carries besides tensors: the source's training state when
    it has one (Megatron legacy, ``torch_dist``), else fresh ``args`` and counters."""
    plan = job.plan
    refs: list[TensorRef] = []
    owner, template_path = job.source.owner(plan.source_files[file.carry_from or 0])
    saved = owner.saved_training(template_path)
    saved = saved or SavedTraining()
    if saved.args is not None:
        carried = dict(saved.carried or {})
        if file.carry_rng and saved.rng_state is not None:
            carried["rng_state"] = saved.rng_state  # the same rank of an unchanged grid
        carried = _materialize(carried, refs)
        args = args_for(saved.args, plan.model(), plan.target_layout)
    else:  # no Megatron training state (HF, or an HF model's DCP): fresh args
        carried = {"checkpoint_version": 3.0, "iteration": plan.iteration or 0}
        args = args_for(args_from_spec(plan.model()), plan.model(), plan.target_layout)
    return TrainingState(
        owner,
        template_path,
        carried,
        args,
        {kind: dict(group) for kind, group in saved.templates.items()},
        saved.optimizer_step if saved.optimizer_step is not None else _step(owner),
        refs,
    )


def _step(owner: Checkpoint) -> float | None:
    """Adam's step of a source without Megatron's training state (an HF model's DCP keeps it
    per parameter): the distributed optimizer keeps it per parameter group."""
    return adam_step(owner) if owner.view.has_optimizer else None


def _materialize(obj: Any, found: list[TensorRef]) -> Any:
    """Replace tensors inside carried training state by slots (their bytes are copied as-is)."""
    if isinstance(obj, TensorRef):
        found.append(obj)
        return TensorSlot(f"carried{len(found) - 1}", obj.dtype, obj.shape)
    if isinstance(obj, dict):
        return type(obj)((k, _materialize(v, found)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(_materialize(v, found) for v in obj)
    return obj
