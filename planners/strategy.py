"""Choose how to reach a target layout from what is stored, and say why.

Strategies, each valid only in some situations:

* ``direct``: the stored sharded checkpoint already has the target layout and every file is
  intact: its shards load as they are (copied byte for byte if a destination is given).
* ``shard-to-shard``: every target shard assembled from the overlapping ranges of the stored
  shards.
* ``recovery``: some stored files are lost; what they held is read from a replica or a full
  checkpoint of the same training state, the rest from the surviving shards.
* ``full-then-split``: the target cut from a stored full checkpoint alone.

``auto`` takes the valid strategy the cost model finds fastest; the others stay in the plan as
alternatives with their estimates, or with the reason they could not be used. Pure.
"""

from __future__ import annotations

from ckptctl.errors import CheckpointError, CkptctlError, UsageError
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import Alternative, Plan
from ckptctl.model.profile import StorageProfile
from ckptctl.model.target import TargetPlanner, TargetRequest
from planners.graph import execution_order
from planners.strategies import STRATEGIES, Inapplicable, Situation, Stored

__all__ = ["STRATEGIES", "Inapplicable", "Stored", "plan_auto"]


def plan_auto(
    sharded: Stored | None,
    others: list[Stored],
    target_layout: ParallelLayout,
    *,
    target_url: str | None,
    target: TargetPlanner,
    request: TargetRequest,
    strategy: str = "auto",
    measured: dict[str, StorageProfile] | None = None,
    window: int = 0,
) -> Plan:
    """The plan of the chosen strategy, with every strategy weighed as an alternative.

    ``measured`` maps URL prefixes to calibrated storage profiles; ``window``: the bytes the
    executor holds between reading and writing (``planners.cost``)."""
    names = [name for name, _ in STRATEGIES]
    if strategy != "auto" and strategy not in names:
        raise UsageError(f"--strategy {strategy}: choose auto or one of {', '.join(names)}")
    if sharded is None and not others:
        raise UsageError("nothing stored to plan from")
    situation = Situation(
        sharded,
        {f"@{i}/": o for i, o in enumerate(others)},
        target_layout,
        target_url,
        target,
        request,
        measured or {},
        window,
    )
    results: dict[str, Plan] = {}
    errors: dict[str, CkptctlError] = {}
    for name, build in STRATEGIES:
        try:
            results[name] = build(situation)
        except CkptctlError as err:
            errors[name] = err
    if strategy != "auto":
        if strategy not in results:
            why = errors[strategy]
            raise type(why)(f"--strategy {strategy} cannot be used: {why}")
        chosen = strategy
    elif results:
        chosen = min(results, key=lambda n: (results[n].estimates.seconds, names.index(n)))
    else:
        # The first strategy that applied but failed says what is really wrong.
        raise next(
            (e for e in errors.values() if not isinstance(e, Inapplicable)),
            CheckpointError("no strategy can produce the target"),
        )
    alternatives = tuple(
        Alternative(strategy=n, estimates=results[n].estimates)
        if n in results
        else Alternative(strategy=n, refused=str(errors[n]))
        for n in names
        if n != chosen
    )
    return execution_order(results[chosen]).model_copy(update={"alternatives": alternatives})
