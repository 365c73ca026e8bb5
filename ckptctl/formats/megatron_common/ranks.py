"""Which ranks of a Megatron job write legacy rank files, and where. Pure.

Megatron-LM numbers ranks tensor-parallel fastest, then data-parallel, then pipeline
(``tp-cp-ep-dp-pp``; context parallelism is 1 here); the expert groups cut the same ranks as
expert TP fastest, then EP, then expert DP. A rank writes ``model_optim_rng.pt`` when its expert
data-parallel rank is 0, into ``mp_rank_<tp>[_<pp>][_<ep>]``: its dense (tp, pp) shard and its
(ep, expert tp) share of the experts. With expert TP equal to TP that is one file per
(tp, pp, ep); otherwise the names say less than the files hold, and some layouts lose dense
shards or overwrite one file with another, which we refuse.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ckptctl.errors import LayoutError
from ckptctl.model.layout import ParallelLayout


def rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """``mp_rank_TT``, ``_PPP`` appended when pp > 1 and ``_EEE`` when ep > 1."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return name


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where one global rank sits in the dense and the expert decomposition."""

    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    expert_dp: int

    def directory(self, layout: ParallelLayout) -> str:
        return rank_dir(self.tp, self.pp, layout.pp, self.ep, layout.ep)


def coords(layout: ParallelLayout, rank: int) -> RankCoords:
    """The coordinates of global ``rank`` (Megatron-LM's rank order)."""
    per_stage = layout.tp * layout.dp
    local = rank % per_stage
    etp = layout.expert_tp
    return RankCoords(
        tp=local % layout.tp,
        pp=rank // per_stage,
        dp=local // layout.tp,
        ep=(local // etp) % layout.ep,
        etp=local % etp,
        expert_dp=local // (etp * layout.ep),
    )


def saving_ranks(layout: ParallelLayout) -> tuple[RankCoords, ...]:
    """The ranks that write a legacy rank file, in directory order (pipeline stage, expert
    rank, TP rank); refused when their files would not hold the checkpoint."""
    per_stage = layout.tp * layout.dp
    savers = [
        c for rank in range(per_stage * layout.pp) if (c := coords(layout, rank)).expert_dp == 0
    ]
    dirs = [c.directory(layout) for c in savers]
    clash = sorted(d for d, n in Counter(dirs).items() if n > 1)
    dense = {c.tp for c in savers}
    what = f"tp={layout.tp} etp={layout.expert_tp} ep={layout.ep}: Megatron-LM's legacy rank files"
    if clash:
        raise LayoutError(
            f"{what} collide ({', '.join(clash)}: each written by several ranks with other "
            "expert shards); use --format torch_dist, or --etp no larger than --tp"
        )
    if len(dense) < layout.tp:
        raise LayoutError(
            f"{what} would leave out dense TP shards {sorted(set(range(layout.tp)) - dense)} "
            "(only expert-DP rank 0 saves); use --format torch_dist, or etp x ep >= tp"
        )
    return tuple(sorted(savers, key=lambda c: (c.pp, c.ep, c.tp)))
