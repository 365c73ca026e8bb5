"""What each file of a DeepSpeed ZeRO checkpoint holds, read from its unpickled tree: the
fragments of every parameter in an optimizer file (stages 1/2 by ``param_slice_mappings``,
stage 3 by the per-parameter partitioning), the frozen parameters, the optimizer's groups, and
the checks that the files agree with each other and with the model."""

from __future__ import annotations

from math import prod
from typing import Any

from ckptctl.errors import CheckpointError
from ckptctl.formats.deepspeed.layout import (
    OPTIMIZER_STATE,
    STAGE3_KEYS,
    STAGE12_KEYS,
    FlatKeys,
    Fragment,
    fragment_views,
    fragments,
    partition_numel,
    stage3_fragments,
)
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.formats.torchsave.refs import resolve
from ckptctl.io.storage import Storage
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.hf_layout import OPTIMIZER_KEY
from ckptctl.model.stored import KeyPath, Shape, StoredTensor


def address(value: Any) -> tuple[int, int]:
    """DeepSpeed's ``fragment_address`` (a dataclass, kept as an inert stub): (start, numel)."""
    state = getattr(value, "_state", None) or {}
    return int(state["start"]), int(state["numel"])


def plain(value: Any) -> bool:
    """Built of Python's own containers and scalars only (safe to pickle again as it is)."""
    if isinstance(value, dict):
        return all(plain(k) and plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def optimizer_items(
    reader: TorchZipReader,
    param_shapes: list[dict[str, Shape]],
    entries: dict[str, Any],
    stage3: bool,
) -> tuple[list[tuple[KeyPath, Any, TorchZipReader]], list[dict[str, Any]]]:
    """torch's per-parameter view of DeepSpeed's flat Adam: each parameter takes its flat
    group's ``step``; each group lists its parameters by HF name instead of flat indices."""
    flat = STAGE3_KEYS if stage3 else STAGE12_KEYS
    state = resolve(reader.tree, flat.moments)
    items: list[tuple[KeyPath, Any, TorchZipReader]] = []
    groups = []
    for group in resolve(reader.tree, (*flat.moments[:-1], "param_groups")):
        names = [n for i in group.get("params", ()) for n in param_shapes[int(i)] if n in entries]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        for i in group.get("params", ()):
            step = state[int(i)].get("step")
            items += [
                ((OPTIMIZER_KEY, "state", n, "step"), step, reader) for n in param_shapes[int(i)]
            ]
    items.append(((OPTIMIZER_KEY, "param_groups"), groups, reader))
    return items, groups


def optimizer_fragments(
    tree: Any, param_shapes: list[dict[str, Shape]], rank: int, dp: int, stage3: bool
) -> tuple[list[Fragment], FlatKeys]:
    """Where this rank's share of each trained parameter lies, and the flat tensors' keys."""
    osd = tree[OPTIMIZER_STATE]
    if stage3 != (zero_stage(tree) == 3):
        raise ValueError(
            f"saved by ZeRO stage {zero_stage(tree)}, beside "
            f"{'ZeRO 3' if stage3 else 'ZeRO 1/2'} model states: mixed stages"
        )
    if stage3:
        if "fp32_flat_groups" not in osd:
            raise ValueError("a ZeRO 3 optimizer file without fp32_flat_groups")
        sizes = [ref.shape[0] for ref in osd["fp32_flat_groups"]]
        return stage3_fragments(param_shapes, sizes, rank, dp), STAGE3_KEYS
    if "param_slice_mappings" not in osd or "single_partition_of_fp32_groups" not in osd:
        # ZeRO 1/2 and BF16_Optimizer (DeepSpeed >= 0.10) keep both; older saves do not.
        raise ValueError(
            "no ZeRO partitions (single_partition_of_fp32_groups, param_slice_mappings): saved "
            "by a DeepSpeed too old to map; load and save it again with DeepSpeed >= 0.10"
        )
    masters = osd["single_partition_of_fp32_groups"]
    paddings = osd.get("group_paddings", [0] * len(masters))
    sizes = [m.shape[0] + pad for m, pad in zip(masters, paddings, strict=True)]
    mappings = [{k: address(v) for k, v in g.items()} for g in osd["param_slice_mappings"]]
    return fragments(param_shapes, mappings, rank, sizes), STAGE12_KEYS


def stage3_frozen(
    tree: Any,
    frozen_shapes: dict[str, Shape],
    entries: dict[str, Any],
    rank: int,
    dp: int,
    rel: str,
    storage: Storage,
) -> list[StoredTensor]:
    """A ZeRO 3 rank's share of each frozen parameter, in its ``frozen_param_fragments``."""
    out = []
    held_by = tree.get("frozen_param_fragments") or {}
    for name, shape in frozen_shapes.items():
        numel = prod(shape)
        part = partition_numel(numel, dp)
        held = max(0, min(part, numel - rank * part))
        ref = held_by.get(name)
        if not isinstance(ref, TensorRef) or prod(ref.shape) < held:
            raise CheckpointError(
                f"{storage.describe(rel)}: no frozen_param_fragments[{name!r}] of {held} elements"
            )
        canonical, _, pieces = entries[name]
        frag = Fragment(name, 0, 0, rank * part, held)
        key = ("frozen_param_fragments", name)
        out += fragment_views(frag, shape, pieces, [(key, canonical)], dtype_name(ref.dtype))
    return out


def zero_stage(tree: Any) -> int | None:
    """The ZeRO stage an optimizer file records; ``None`` for DeepSpeed's ``BF16_Optimizer``
    (bf16 with fp32 gradient accumulation), which partitions as ZeRO 1 does but says no stage."""
    stage = tree["optimizer_state_dict"].get("zero_stage")
    if stage is None:
        return None
    args = getattr(stage, "_args", None)
    return int(args[0]) if args else int(stage)


def check_flat(tree: Any, group: int, flat: FlatKeys) -> None:
    master = resolve(tree, (*flat.masters, group))
    moments = resolve(tree, (*flat.moments, group))
    for state in ("exp_avg", "exp_avg_sq"):
        ref = moments.get(state)
        if not isinstance(ref, TensorRef) or len(ref.shape) != 1 or ref.shape[0] < master.shape[0]:
            raise ValueError(
                f"group {group} has no flat {state} covering its fp32 partition "
                "(elastic or foreign optimizer state); cannot map it"
            )


def frozen_shapes(states: Any, param_shapes: list[dict[str, Shape]]) -> dict[str, Shape]:
    """Frozen parameters and their shapes: ``frozen_param_shapes`` (ZeRO 2 and 3), or, as
    ZeRO 1 records none (``zero_to_fp32`` drops them), the 16-bit ``module``'s tensors that are
    neither trained, tied aliases nor buffers."""
    recorded = states.get("frozen_param_shapes")
    if recorded:
        return {name: tuple(shape) for name, shape in recorded.items()}
    trained = {name for group in param_shapes for name in group}
    skip = set((states.get("shared_params") or {}).keys()) | set(states.get("buffer_names") or ())
    module = states.get("module") or {}
    return {
        name: tuple(ref.shape)
        for name, ref in module.items()
        if isinstance(ref, TensorRef) and name not in trained and name not in skip
    }


def frozen_keys(states: Any, frozen: dict[str, Shape]) -> dict[str, KeyPath]:
    """Where ZeRO 1/2 keep each frozen parameter whole: ``frozen_param_fragments`` (ZeRO 2) or
    the ``module``."""
    kept = states.get("frozen_param_fragments") or {}
    return {n: ("frozen_param_fragments", n) if n in kept else ("module", n) for n in frozen}


def check_names(
    entries: dict[str, Any],
    param_shapes: list[dict[str, Shape]],
    frozen: dict[str, Shape],
    states: Any,
    where: str,
) -> None:
    """Every parameter the HF model has is trained, frozen or a tied alias, with its shape."""
    held = {name: shape for group in param_shapes for name, shape in group.items()}
    held.update(frozen)
    aliases = set((states.get("shared_params") or {}).keys())
    unknown = sorted(set(held) - set(entries))
    missing = sorted(set(entries) - set(held) - aliases)
    wrong = sorted(n for n in set(held) & set(entries) if tuple(held[n]) != entries[n][1])
    problems = []
    if unknown:
        problems.append(f"parameters the model config does not have: {', '.join(unknown[:5])}")
    if missing:
        problems.append(f"no parameter {', '.join(missing[:5])}")
    if wrong:
        problems.append(
            "shapes differ from the model config: "
            + ", ".join(f"{n} {list(held[n])} vs {list(entries[n][1])}" for n in wrong[:5])
        )
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))
