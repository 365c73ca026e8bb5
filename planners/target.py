"""The target of a reshard: what the user asked for, and the source's choice for everything
else. Pure.

Nothing the user did not give is replaced by a default of ckptctl's: each axis (TP, PP, DP,
EP, expert TP, virtual pipeline), the pipeline's stage split and the distributed optimizer
keep the source's value. An expert TP equal to the source's TP is Megatron's default ("as
TP"), and stays so: it follows a new TP. Two of them describe a pipeline of a given depth and
cannot outlive a change of it: an uneven first/last stage split is kept only while PP is, and
a virtual pipeline only while it still divides every stage's layers; where they fall, the
notes say so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ckptctl.errors import LayoutError, UsageError
from ckptctl.model.layout import ModelSpec, ParallelLayout

AXES = (
    "tp",
    "pp",
    "dp",
    "vpp",
    "ep",
    "etp",
    "first_stage_layers",
    "last_stage_layers",
    "distributed_optimizer",
    "even_stages",
)
"""The target's fields the user may give (``None``: keep the source's); ``even_stages``
asks for layers split evenly over PP, whatever the source's split."""


@dataclass(frozen=True, slots=True)
class TargetChoice:
    layout: ParallelLayout
    notes: tuple[str, ...]
    """Where the source's value could not be kept, and what was taken instead."""


def choose_target(
    source: ParallelLayout, spec: ModelSpec | None, given: Mapping[str, object]
) -> TargetChoice:
    """The layout to write: ``given`` values (``None`` or absent: not given), the source's
    for the rest."""
    unknown = set(given) - set(AXES)
    if unknown:
        raise ValueError(f"not target layout fields: {sorted(unknown)}")
    asked = {k: v for k, v in given.items() if v is not None}
    even = bool(asked.pop("even_stages", False))
    if even and {"first_stage_layers", "last_stage_layers"} & set(asked):
        raise UsageError("--even-stages and --pp-first/last-stage-layers contradict each other")
    notes: list[str] = []
    values: dict[str, object] = {
        "tp": source.tp,
        "pp": source.pp,
        "dp": source.dp,
        "ep": source.ep,
        "distributed_optimizer": source.distributed_optimizer,
        **{k: v for k, v in asked.items() if k not in ("vpp", "etp")},
    }
    # The source's expert TP: its own value where it had one apart from TP, else "as TP"
    # (Megatron's default), which follows the target's TP.
    etp = asked.get("etp", source.etp)
    values["etp"] = None if etp == values["tp"] else etp  # "as TP", however it was said
    same_pipeline = values["pp"] == source.pp
    split = (source.first_stage_layers, source.last_stage_layers)
    kept_split = not even and not ({"first_stage_layers", "last_stage_layers"} & set(asked))
    if kept_split:
        if same_pipeline:
            values["first_stage_layers"], values["last_stage_layers"] = split
        elif split != (None, None):
            notes.append(
                f"stage split: even over PP{values['pp']} (the source's first/last stage "
                f"layers {split[0]}/{split[1]} were for PP{source.pp}); give "
                "--pp-first-stage-layers/--pp-last-stage-layers to choose another"
            )
    pipelined = int(values["pp"]) > 1  # type: ignore[call-overload]
    values["vpp"] = asked.get("vpp", source.vpp if pipelined else 1)
    layout = ParallelLayout(**values)  # type: ignore[arg-type]
    if "vpp" not in asked and source.vpp > 1 and not pipelined:
        notes.append(f"virtual pipeline: none (the source's VPP{source.vpp} needs PP > 1)")
    if spec is None or _fits(layout, spec):
        return TargetChoice(layout, tuple(notes))
    # A value kept from the source that does not fit what was given yields to it: first the
    # stage split, then the virtual pipeline (what was given is never changed).
    if kept_split and same_pipeline and split != (None, None):
        evened = layout.model_copy(update={"first_stage_layers": None, "last_stage_layers": None})
        if _fits(evened, spec) or "vpp" not in asked:
            notes.append(
                f"stage split: even (the source's first/last stage layers {split[0]}/{split[1]} "
                "do not fit what was given)"
            )
            layout = evened
    if "vpp" not in asked and layout.vpp > 1 and not _fits(layout, spec):
        notes.append(
            f"virtual pipeline: none (the source's VPP{layout.vpp} does not divide the layers "
            f"of every stage of PP{layout.pp}); give --vpp to choose one"
        )
        layout = layout.model_copy(update={"vpp": 1})
    return TargetChoice(layout, tuple(notes))


def _fits(layout: ParallelLayout, spec: ModelSpec) -> bool:
    try:
        layout.chunk_layers(spec.num_layers)
    except LayoutError:
        return False
    return True


def changes(source: ParallelLayout, target: ParallelLayout) -> list[str]:
    """What differs between two layouts, in words (``PP 2 -> 1``), for a job's summary."""
    out = []
    experts = {source.ep, target.ep} != {1} or (source.etp, target.etp) != (None, None)
    for label, field in (
        ("TP", "tp"),
        ("PP", "pp"),
        ("DP", "dp"),
        ("VPP", "vpp"),
        ("EP", "ep"),
        ("ETP", "expert_tp"),
        ("first stage layers", "first_stage_layers"),
        ("last stage layers", "last_stage_layers"),
    ):
        before, after = getattr(source, field), getattr(target, field)
        if field == "expert_tp" and not experts:
            continue  # a dense model has no expert tensor parallelism to speak of
        if before != after:
            out.append(f"{label} {before} -> {after}")
    if source.distributed_optimizer != target.distributed_optimizer:
        out.append(
            "distributed optimizer "
            + ("off -> on" if target.distributed_optimizer else "on -> off")
        )
    return out
