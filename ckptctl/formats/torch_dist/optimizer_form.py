"""How a ``torch_dist`` checkpoint keeps the distributed optimizer's state: ``dp_reshardable``
(Megatron's grad-buffer buckets), ``fully_reshardable`` (per parameter) or
``fully_sharded_model_space`` (per parameter, N-D flattened: megatron-core <= 0.14), for a
source and for a plan's target, and the note a reshard gives when the two differ. Pure."""

from __future__ import annotations

from ckptctl.formats.megatron_common.distopt_layout import is_bucket_key
from ckptctl.formats.torch_dist.model_space import is_model_space_key
from ckptctl.model.plan import Plan
from ckptctl.model.stored import CheckpointView, Format


def source_form(view: CheckpointView) -> str | None:
    """How a ``torch_dist`` source keeps the distributed optimizer's state (``None``: it keeps
    none, or is no ``torch_dist`` checkpoint)."""
    if view.format != Format.TORCH_DIST or not view.layout.distributed_optimizer:
        return None
    if not view.has_optimizer:
        return None
    keys = [str(t.key[0]) for f in view.files for t in f.tensors]
    return _form(keys)


def _form(keys: list[str]) -> str:
    if any(is_bucket_key(k) for k in keys):
        return "dp_reshardable"
    if any(is_model_space_key(k) for k in keys):
        return "fully_sharded_model_space"
    return "fully_reshardable"


def optimizer_form(plan: Plan) -> str | None:
    """How a plan's ``torch_dist`` target keeps the distributed optimizer's state."""
    if plan.target_format != Format.TORCH_DIST or not plan.target_layout.distributed_optimizer:
        return None
    tensors = [t for f in plan.files for t in f.tensors]
    if not any(t.canonical.startswith("exp_avg/") for t in tensors):
        return None
    return _form([str(t.key[0]) for t in tensors])


def form_change_notes(source: CheckpointView, plan: Plan) -> tuple[str, ...]:
    """Says so when the distributed optimizer's state changes form (``--optim-sharding``)."""
    before, after = source_form(source), optimizer_form(plan)
    if before is None or after is None or before == after:
        return ()
    return (
        f"the distributed optimizer's state is written {after}, not {before} as the source "
        "keeps it",
    )
