"""The distributed optimizer's grad-buffer layout of every model-parallel group, replayed as
``distrib_optim.pt`` would lay it out: what ``dp_reshardable`` buckets hold, read and written.
Pure.

Megatron keeps one set of buckets per group of each sub-optimizer: the dense one's per
(pipeline stage, TP rank), the expert one's (under EP > 1, a chained optimizer) per (stage, EP
rank, expert TP rank). Legacy rank files cannot stand for these groups when expert TP differs
from TP (several ranks would share a directory), so each group is replayed on the first rank
that holds it, whatever files a legacy checkpoint of the layout would have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ckptctl.formats.megatron_common.layout import ExpertNaming, distopt_file, rank_params
from ckptctl.formats.megatron_common.ranks import RankCoords, coords
from ckptctl.model.catalog import Naming
from ckptctl.model.geometry import shard_shape_and_pieces
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import OptimizerLayout
from ckptctl.model.stored import KeyPath, StoredTensor


@dataclass(frozen=True, slots=True)
class GroupState:
    """One sub-optimizer's flat state on one model-parallel group."""

    sub: int
    """0: the dense optimizer (the only one unless chained); 1: the experts'."""
    group: int
    """Megatron's ``dp_group_idx``: the group's rank in the model-parallel group (TP fastest,
    then PP) or, for the experts', in the expert tensor-model-pipeline group (expert TP
    fastest, then EP, then PP)."""
    owner: tuple[tuple[int, int], int]
    """The ``torch_dist`` file (``(tp, pp)``, EP rank) its bucket chunks are written to: the
    dense group's own, the expert group's whose TP rank its expert TP rank falls to."""
    tensors: tuple[StoredTensor, ...]
    """Each parameter's state in the stripped concatenation of the group's buffers (key
    ``(*sub, grad buffer, dtype key, state)``, from ``view_offset``)."""
    buckets: dict[KeyPath, tuple[int, ...]]
    """Per buffer and state: its buckets' unpadded sizes."""


def group_of(layout: ParallelLayout, sub: int, rank: RankCoords) -> int:
    """The index Megatron names a rank's bucket keys by (``dp_group_idx``): its rank in the
    model-parallel group of the dense optimizer, or in the expert tensor-model-pipeline group
    of the expert one."""
    if sub == 0:
        return rank.pp * layout.tp + rank.tp
    return (rank.pp * layout.ep + rank.ep) * layout.expert_tp + rank.etp


def replay(
    spec: ModelSpec,
    layout: ParallelLayout,
    optimizer: OptimizerLayout,
    weight_dtype: str,
    naming: Naming,
    expert_naming: ExpertNaming,
) -> list[GroupState]:
    """Every group's flat state, dense groups first, in group order."""
    optimizer = replace(optimizer, distributed=True)
    first: dict[tuple[int, int], RankCoords] = {}
    for rank in (coords(layout, r) for r in range(layout.tp * layout.dp * layout.pp)):
        if rank.dp == 0:
            first.setdefault((0, group_of(layout, 0, rank)), rank)
        if optimizer.chained and rank.expert_dp == 0:
            first.setdefault((1, group_of(layout, 1, rank)), rank)
    padded = spec.padded_vocab_size(layout.tp)
    out = []
    for (sub, group), rank in sorted(first.items()):
        params = rank_params(spec, layout, rank.pp, naming, None, rank.ep, expert_naming)
        geometry = [
            shard_shape_and_pieces(
                rp.param.split,
                rp.param.shape,
                *(
                    (layout.tp, rank.tp)
                    if rp.param.expert is None
                    else (layout.expert_tp, rank.etp)
                ),
                padded,
                rp.param.parts,
            )
            for rp in params
        ]
        file = distopt_file(
            "", params, geometry, layout, rank, optimizer, weight_dtype, spec.tie_embeddings
        )
        mine = tuple(t for t in file.tensors if (int(t.key[0]) if optimizer.chained else 0) == sub)
        keys = {t.key for t in mine}
        owner_tp = rank.tp if sub == 0 else rank.etp % layout.tp
        out.append(
            GroupState(
                sub,
                group,
                ((owner_tp, rank.pp), rank.ep if sub == 1 else 0),
                mine,
                {k: v for k, v in file.buckets if k in keys},
            )
        )
    return out
