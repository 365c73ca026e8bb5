"""DeepSpeed ZeRO stage 1/2 checkpoints as geometry over canonical tensors. Pure.

Each parameter group is flattened (parameters in ``param_shapes`` order, no gaps), padded to a
multiple of the data-parallel size and cut into equal partitions, one per DP rank's
``*_optim_states.pt``: its fp32 masters (``single_partition_of_fp32_groups[g]``) and Adam moments
(``base_optimizer_state['state'][g]``), each a 1-D tensor. ``param_slice_mappings[g]`` says where
each parameter's fragment starts in the rank's partition. A fragment is a run of a parameter's
flattened elements, which we describe as the few contiguous boxes it covers (a partial row, whole
rows, a partial row), each a view of the flat partition mapped onto canonical tensors through the
HF name's own pieces (q/k/v into the fused QKV, gate/up into ``linear_fc1``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

from ckptctl.model.catalog import state_name
from ckptctl.model.geometry import Piece, Shape, chunk_pieces
from ckptctl.model.stored import KeyPath, StoredTensor

LATEST = "latest"
MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
STAGE3_MODEL_STATES = re.compile(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$")
OPTIMIZER_STATE = "optimizer_state_dict"


def recognised(names: frozenset[str]) -> bool:
    """A DeepSpeed checkpoint directory (``latest``, and no Megatron tracker beside it) or one
    of its tag directories."""
    tagged = LATEST in names and "latest_checkpointed_iteration.txt" not in names
    return tagged or any(MODEL_STATES.match(n) for n in names)


MASTERS = (OPTIMIZER_STATE, "single_partition_of_fp32_groups")
MOMENTS = (OPTIMIZER_STATE, "base_optimizer_state", "state")
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def flat_boxes(shape: Shape, start: int, stop: int) -> list[tuple[int, Shape, Shape]]:
    """Elements ``[start, stop)`` of a C-contiguous tensor of ``shape`` as boxes that are each
    contiguous in memory: (position of the box's first element after ``start``, box offsets,
    box sizes), in memory order."""
    if start >= stop:
        return []
    if not shape:
        return [(0, (), ())]
    row = prod(shape[1:])
    first_full, last_full = -(-start // row), stop // row
    out: list[tuple[int, Shape, Shape]] = []

    def within(r: int, lo: int, hi: int) -> None:
        for off, o, s in flat_boxes(shape[1:], lo - r * row, hi - r * row):
            out.append((lo - start + off, (r, *o), (1, *s)))

    if first_full > last_full:  # inside one row
        within(start // row, start, stop)
        return out
    if start < first_full * row:
        within(start // row, start, first_full * row)
    if last_full > first_full:
        zeros = (0,) * (len(shape) - 1)
        out.append(
            (first_full * row - start, (first_full, *zeros), (last_full - first_full, *shape[1:]))
        )
    if stop > last_full * row:
        within(last_full, last_full * row, stop)
    return out


@dataclass(frozen=True, slots=True)
class Fragment:
    """Elements ``[begin, begin + numel)`` of parameter ``name`` (flattened) lie from ``start``
    in a rank's partition of group ``group``."""

    name: str
    group: int
    start: int
    begin: int
    numel: int


def fragments(
    param_shapes: list[dict[str, Shape]],
    slice_mappings: list[dict[str, tuple[int, int]]],
    rank: int,
    partition_sizes: list[int],
) -> list[Fragment]:
    """The fragments one DP rank holds: ``slice_mappings[g][name] = (start, numel)`` in the
    rank's partition; the partition of group g starts at ``rank * partition_sizes[g]`` of the
    group's flat tensor, where the parameters follow each other in ``param_shapes`` order."""
    out = []
    for g, (shapes, mapping) in enumerate(zip(param_shapes, slice_mappings, strict=True)):
        offset, first = 0, {}
        for name, shape in shapes.items():
            first[name] = offset
            offset += prod(shape)
        base = rank * partition_sizes[g]
        for name, (start, numel) in mapping.items():
            if name not in first:
                raise ValueError(f"a fragment of {name}, which param_shapes does not list")
            begin = base + start - first[name]
            if begin < 0 or begin + numel > prod(shapes[name]):
                raise ValueError(f"the fragment ({start}, {numel}) of {name} lies outside it")
            out.append(Fragment(name, g, start, begin, numel))
    return out


def fragment_tensors(
    fragment: Fragment, shape: Shape, canonical: str, pieces: tuple[Piece, ...]
) -> list[StoredTensor]:
    """The fp32 master and Adam moments of one fragment, as views of the rank's flat tensors."""
    out = []
    for offset, box_lo, box_sizes in flat_boxes(
        shape, fragment.begin, fragment.begin + fragment.numel
    ):
        local = chunk_pieces(pieces, box_lo, box_sizes)
        if not local:
            continue
        at = fragment.start + offset
        keys: list[tuple[KeyPath, str]] = [((*MASTERS, fragment.group), canonical)]
        keys += [((*MOMENTS, fragment.group, s), state_name(s, canonical)) for s in ADAM_STATES]
        for key, name in keys:
            out.append(StoredTensor(key, name, box_sizes, "float32", local, view_offset=at))
    return out
