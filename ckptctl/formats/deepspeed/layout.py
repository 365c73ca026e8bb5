"""DeepSpeed ZeRO stage 1/2/3 checkpoints as geometry over canonical tensors. Pure.

Stages 1 and 2: each parameter group is flattened (parameters in ``param_shapes`` order, no
gaps), padded to a multiple of the data-parallel size and cut into equal partitions, one per DP
``*_optim_states.pt``: its fp32 masters (``single_partition_of_fp32_groups[g]``) and Adam moments
(``base_optimizer_state['state'][g]``), each a 1-D tensor. ``param_slice_mappings[g]`` says where
each parameter's fragment starts in the rank's partition. A fragment is a run of a parameter's
flattened elements, which we describe as the few contiguous boxes it covers (a partial row, whole
rows, a partial row), each a view of the flat partition mapped onto canonical tensors through the
HF name's own pieces (q/k/v into the fused QKV, gate/up into ``linear_fc1``).

Stage 3 partitions every parameter on its own: rank r holds elements ``[r*p, (r+1)*p)`` of each
(``p = ceil(numel / dp)``, the last share padded), one after another in ``param_shapes`` order
through the rank's flat groups (``fp32_flat_groups``, DeepSpeed's sub-groups), and frozen
parameters the same way in its ``frozen_param_fragments``.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from math import prod

from ckptctl.model.catalog import state_name
from ckptctl.model.geometry import Piece, Shape, chunk_pieces
from ckptctl.model.stored import KeyPath, StoredTensor

LATEST = "latest"
MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
STAGE3_MODEL_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIMIZER_STATE = "optimizer_state_dict"

# A universal checkpoint (``ds_to_universal``'s layout, DeepSpeed 0.19.8):
#   latest_universal                      the tag
#   <tag>/mp_rank_00_model_states.pt      counters and world sizes the engine reads first
#   <tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, where a ZeRO 3 engine looks
#   <tag>/zero/optimizer_state.pt         parameter groups' settings, loss scaling
#   <tag>/zero/<HF name>/fp32.pt          {"param": fp32 tensor} (ZeRO 3 may keep bare tensors)
#   <tag>/zero/<HF name>/exp_avg.pt       the same, for trained parameters; exp_avg_sq.pt too
#   <tag>/zero/<HF name>/step.pt          Adam's step, a 0-d tensor
LATEST_UNIVERSAL = "latest_universal"
UNIVERSAL_ZERO = "zero"
UNIVERSAL_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
UNIVERSAL_OPTIMIZER_STATE = "zero/optimizer_state.pt"
PARAM_KEY = ("param",)
"""Where a parameter's state file keeps its tensor."""
STEP_KEY = ("step",)
"""Marks a step file: the tensor itself (``torch.save(step)``)."""
UNIVERSAL_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def universal_tag(iteration: int | None) -> str:
    return f"global_step{iteration or 0}_universal"


def recognised(names: frozenset[str]) -> bool:
    """A DeepSpeed checkpoint directory (``latest``, and no Megatron tracker beside it) or one
    of its tag directories."""
    tagged = LATEST in names and "latest_checkpointed_iteration.txt" not in names
    return tagged or (holds_model_states(names) and UNIVERSAL_ZERO not in names)


def recognised_universal(names: frozenset[str]) -> bool:
    """A universal checkpoint directory (``latest_universal``) or its tag directory."""
    tagged = LATEST_UNIVERSAL in names and LATEST not in names  # else the ZeRO save is meant
    return tagged or (UNIVERSAL_ZERO in names and holds_model_states(names))


def holds_model_states(names: frozenset[str] | set[str]) -> bool:
    """A tag directory: stage 1/2 or stage 3 model-state files."""
    return any(MODEL_STATES.match(n) or STAGE3_MODEL_STATES.match(n) for n in names)


MASTERS = (OPTIMIZER_STATE, "single_partition_of_fp32_groups")
MOMENTS = (OPTIMIZER_STATE, "base_optimizer_state", "state")
STAGE3_MASTERS = (OPTIMIZER_STATE, "fp32_flat_groups")
STAGE3_MOMENTS = (OPTIMIZER_STATE, OPTIMIZER_STATE, "state")


@dataclass(frozen=True, slots=True)
class FlatKeys:
    """Where a ZeRO optimizer file keeps its flat fp32 masters and its Adam state, per group."""

    masters: KeyPath
    moments: KeyPath


STAGE12_KEYS = FlatKeys(MASTERS, MOMENTS)
STAGE3_KEYS = FlatKeys(STAGE3_MASTERS, STAGE3_MOMENTS)
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


def partition_numel(numel: int, dp: int) -> int:
    """Elements of a parameter each ZeRO 3 rank holds (the last rank's share padded)."""
    return -(-numel // dp)


def stage3_fragments(
    param_shapes: list[dict[str, Shape]], flat_sizes: list[int], rank: int, dp: int
) -> list[Fragment]:
    """The fragments one ZeRO 3 rank holds in its flat groups of ``flat_sizes`` elements (a
    share that crosses from one flat group into the next is split at the boundary)."""
    bounds = list(accumulate(flat_sizes, initial=0))
    out: list[Fragment] = []
    offset = 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = prod(shape)
            part = partition_numel(numel, dp)
            held = max(0, min(part, numel - rank * part))
            if offset + part > bounds[-1]:
                raise ValueError(
                    f"{name}'s partition ends at element {offset + part} of {bounds[-1]} in "
                    "the rank's flat groups"
                )
            done = 0
            while done < held:
                at = offset + done
                g = bisect_right(bounds, at) - 1
                run = min(held - done, bounds[g + 1] - at)
                out.append(Fragment(name, g, at - bounds[g], rank * part + done, run))
                done += run
            offset += part
    if offset != bounds[-1]:
        raise ValueError(
            f"param_shapes account for {offset} elements per rank, the flat groups hold "
            f"{bounds[-1]}"
        )
    return out


def fragment_views(
    fragment: Fragment,
    shape: Shape,
    pieces: tuple[Piece, ...],
    keys: list[tuple[KeyPath, str]],
    dtype: str = "float32",
) -> list[StoredTensor]:
    """One fragment of every flat tensor in ``keys`` (key path, canonical name), as views."""
    out = []
    for offset, box_lo, box_sizes in flat_boxes(
        shape, fragment.begin, fragment.begin + fragment.numel
    ):
        local = chunk_pieces(pieces, box_lo, box_sizes)
        if not local:
            continue
        at = fragment.start + offset
        for key, name in keys:
            out.append(StoredTensor(key, name, box_sizes, dtype, local, view_offset=at))
    return out


def fragment_tensors(
    fragment: Fragment,
    shape: Shape,
    canonical: str,
    pieces: tuple[Piece, ...],
    flat: FlatKeys = STAGE12_KEYS,
) -> list[StoredTensor]:
    """The fp32 master and Adam moments of one fragment, as views of the rank's flat tensors."""
    keys: list[tuple[KeyPath, str]] = [((*flat.masters, fragment.group), canonical)]
    keys += [((*flat.moments, fragment.group, s), state_name(s, canonical)) for s in ADAM_STATES]
    return fragment_views(fragment, shape, pieces, keys)
