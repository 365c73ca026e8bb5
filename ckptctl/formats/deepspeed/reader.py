"""Reading DeepSpeed ZeRO checkpoints: ``latest`` (or ``--tag``) names the tag directory. Stages
1 and 2 keep ``mp_rank_00_model_states.pt`` (16-bit module, ``param_shapes``, frozen parameters,
tied aliases) and one ``[bf16_]zero_pp_rank_<dp>_mp_rank_00_optim_states.pt`` per DP rank (fp32
masters and Adam moments of its flat partitions); stage 3 a model-states file per rank too, with
its share of the frozen parameters. The fp32 masters are the weights; frozen parameters come
from the model states. The model is the HF one ``config.json`` (beside the checkpoint, or
``--hf-config``) describes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from ckptctl.errors import CheckpointError, CheckpointNotFoundError, LayoutError
from ckptctl.formats.base import ProbeRequest, SavedTraining
from ckptctl.formats.deepspeed.layout import (
    LATEST,
    MODEL_STATES,
    OPTIM_STATES,
    OPTIMIZER_STATE,
    STAGE3_KEYS,
    STAGE3_MODEL_STATES,
    STAGE12_KEYS,
    FlatKeys,
    Fragment,
    fragment_tensors,
    fragment_views,
    fragments,
    holds_model_states,
    partition_numel,
    stage3_fragments,
)
from ckptctl.formats.hf.families import spec_from_config
from ckptctl.formats.hf.layout import CONFIG, MODEL_KEY, OPTIMIZER_KEY, hf_tensors
from ckptctl.formats.megatron.layout import GroupOrder, MegatronStyle, OptimizerLayout
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.formats.torchsave.refs import open_torch_file, read_box, resolve
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.geometry import Piece
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.stored import (
    CheckpointView,
    FlatView,
    Format,
    KeyPath,
    Shape,
    StoredFile,
    StoredTensor,
)
from ckptctl.storage import Storage


@dataclass
class DeepSpeedCheckpoint:
    storage: Storage
    view: CheckpointView
    readers: dict[str, TorchZipReader]
    items: list[tuple[KeyPath, Any, TorchZipReader]]
    """Adam's step per parameter and the parameter groups, for an HF torch state dict."""
    aliases: dict[KeyPath, KeyPath]
    """Tied parameters (``shared_params``), by their key path in that state dict."""
    groups: list[dict[str, Any]]
    """The optimizer's parameter groups: settings, and ``params`` as HF names."""
    kept: dict[str, Any]
    """Model-state entries a universal checkpoint carries on (shapes, counters, scheduler)."""

    def param_groups(self) -> list[dict[str, Any]]:
        return self.groups

    @property
    def style(self) -> MegatronStyle:
        """Adam state per group, as Megatron's distributed optimizer keeps it: a Megatron
        target stores it per parameter (fp32 weights: ``FP32Optimizer``) or in its own flat
        buffers."""
        if not self.view.has_optimizer:
            return MegatronStyle()
        layout = OptimizerLayout(states=(), distributed=True, group_order=GroupOrder.DECAY_FIRST)
        return MegatronStyle(optimizer=layout)

    def saved_training(self, path: str) -> SavedTraining:
        """The parameter groups' settings by kind (True: no weight decay) and Adam's step;
        no Megatron args or counters (a Megatron target gets fresh ones)."""
        templates = {
            float(g.get("weight_decay", 0.0)) == 0.0: {k: v for k, v in g.items() if k != "params"}
            for g in self.groups
        }
        return SavedTraining(templates=templates, optimizer_step=self.view.optimizer_step)

    def universal_model_state(self) -> dict[str, Any]:
        return self.kept

    def state_dict_items(self) -> list[tuple[KeyPath, Any, TorchZipReader]]:
        return self.items

    def state_dict_aliases(self) -> dict[KeyPath, KeyPath]:
        return self.aliases

    def read(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> torch.Tensor:
        return read_box(self.readers[path], key, offsets, sizes, view)


def tag_dir(
    storage: Storage,
    names: frozenset[str],
    asked: str | None,
    latest: str = LATEST,
    is_tag: Callable[[frozenset[str]], bool] = holds_model_states,
) -> str:
    """The tag directory, relative to the root: ``--tag``, the one ``latest`` names, or the
    root itself when it is a tag directory."""
    if asked is None and is_tag(names):
        return ""
    where = "--tag" if asked is not None else storage.describe(latest)
    tag = asked if asked is not None else storage.read_text(latest).strip()
    if not tag or "/" in tag or tag in (".", ".."):
        raise CheckpointError(f"{where}: {tag!r} is not a tag directory name")
    if not storage.isdir(tag):
        tags = sorted(n for n in names if storage.isdir(n))
        raise CheckpointNotFoundError(
            f"{storage.describe(tag)}: no such tag (named by {where}); tags here: "
            + (", ".join(tags[:8]) or "none")
        )
    return tag


def model_config(
    storage: Storage, request: ProbeRequest, tag: str, required: bool = True
) -> dict[str, Any] | None:
    """The HF ``config.json`` given or beside the checkpoint (``None`` if neither and not
    ``required``)."""
    if request.hf_config is not None:
        return dict(request.hf_config)
    if not storage.exists(CONFIG) and not required:
        return None
    if not storage.exists(CONFIG):
        where = storage.describe(CONFIG)
        raise CheckpointError(
            f"{where}: missing, so the model is unknown; pass --hf-config CONFIG.json"
            + (" (the checkpoint was given as its tag directory)" if not tag else "")
        )
    try:
        return json.loads(storage.read_text(CONFIG))
    except ValueError as err:
        raise CheckpointError(f"{storage.describe(CONFIG)}: not JSON ({err})") from None


def _address(value: Any) -> tuple[int, int]:
    """DeepSpeed's ``fragment_address`` (a dataclass, kept as an inert stub): (start, numel)."""
    state = getattr(value, "_state", None) or {}
    return int(state["start"]), int(state["numel"])


def _ranked(listing: set[str], pattern: re.Pattern[str], group: int) -> list[tuple[int, str]]:
    return sorted((int(m.group(group)), n) for n in listing if (m := pattern.match(n)))


def probe_deepspeed(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    tag = tag_dir(storage, names, request.tag)

    def join(name: str) -> str:
        return f"{tag}/{name}" if tag else name

    listing = set(storage.listdir(tag)) if tag else set(names)
    where = storage.describe(tag)
    stage3 = _ranked(listing, STAGE3_MODEL_STATES, 1)
    models = _ranked(listing, MODEL_STATES, 1)
    optim = _ranked(listing, OPTIM_STATES, 2)
    if stage3 and models:
        raise CheckpointError(
            f"{where}: both ZeRO 1/2 (mp_rank_*_model_states.pt) and ZeRO 3 "
            "(zero_pp_rank_*_model_states.pt) files: mixed stages; keep one save per tag"
        )
    mp = {int(OPTIM_STATES.match(n).group(3)) for _, n in optim}  # type: ignore[union-attr]
    mp |= {int(STAGE3_MODEL_STATES.match(n).group(2)) for _, n in stage3}  # type: ignore[union-attr]
    if len(models) > 1 or mp - {0}:
        raise CheckpointError(
            f"{where}: several model-parallel ranks; only mp_rank_00 (no TP/PP) is supported"
        )
    first = join((stage3 or models)[0][1])
    readers = {first: open_torch_file(storage, first)}
    states = readers[first].tree
    dp = int(states.get("dp_world_size", 0))
    for kind, ranked in (("optimizer", optim), ("model-state", stage3 if stage3 else None)):
        ranks = [r for r, _ in ranked] if ranked is not None else list(range(dp))
        if ranks != list(range(dp)):
            raise CheckpointNotFoundError(
                f"{where}: {kind} files for DP ranks {ranks}, but dp_world_size={dp}; a rank "
                "file is missing or foreign"
            )
    param_shapes = [{k: tuple(v) for k, v in g.items()} for g in states["param_shapes"]]
    frozen_shapes = _frozen_shapes(states, param_shapes)
    config = model_config(storage, request, tag, required=False)
    notes = []
    if config is None:
        # No model description: every parameter whole under its own name, which is all a
        # torch state dict (or a universal checkpoint) needs.
        spec = None
        entries = {
            name: (name, shape, (Piece((0,) * len(shape), (0,) * len(shape), shape),))
            for group in (*param_shapes, frozen_shapes)
            for name, shape in group.items()
        }
        notes.append(
            f"{storage.describe(CONFIG)} missing: tensors keep DeepSpeed's names (--format torch "
            "or deepspeed-universal); pass --hf-config CONFIG.json for HF and Megatron targets"
        )
    else:
        try:
            spec = spec_from_config(config, 128, request.trusted_fields)
        except LayoutError as err:
            raise LayoutError(f"{storage.describe(CONFIG)}: {err}") from None
        entries = {hf: (c, shape, pieces) for hf, c, shape, pieces in hf_tensors(spec)}
        _check_names(entries, param_shapes, frozen_shapes, states, storage.describe(first))

    files: list[StoredFile] = []
    steps: set[float] = set()
    for rank, name in optim:
        rel = join(name)
        reader = readers[rel] = open_torch_file(storage, rel)
        tensors: list[StoredTensor] = []
        try:
            frags, flat = _optimizer_fragments(reader.tree, param_shapes, rank, dp, bool(stage3))
            for frag in frags:
                canonical, shape, pieces = entries[frag.name]
                tensors += fragment_tensors(frag, shape, canonical, pieces, flat)
            for g in range(len(resolve(reader.tree, flat.masters))):
                _check_flat(reader.tree, g, flat)
                step = resolve(reader.tree, (*flat.moments, g)).get("step")
                steps.add(float(reader.read(step).item()) if isinstance(step, TensorRef) else step)
        except ValueError as err:
            raise CheckpointError(f"{storage.describe(rel)}: {err}") from None
        files.append(StoredFile(rel, tuple(tensors)))
    steps.discard(None)  # type: ignore[arg-type]
    if stage3:
        for rank, name in stage3:
            rel = join(name)
            reader = readers.setdefault(rel, open_torch_file(storage, rel))
            frozen = _stage3_frozen(reader.tree, frozen_shapes, entries, rank, dp, rel, storage)
            files.insert(rank, StoredFile(rel, tuple(frozen)))
    else:
        frozen = []
        for hf, key in _frozen_keys(states, frozen_shapes).items():
            canonical, shape, pieces = entries[hf]
            dtype = dtype_name(resolve(states, key).dtype)
            frozen.append(StoredTensor(key, canonical, shape, dtype, pieces))
        files.insert(0, StoredFile(first, tuple(frozen)))
    files = [f for f in files if f.tensors]
    if len(steps) > 1:
        raise CheckpointError(f"{where}: parameter groups at different Adam steps {sorted(steps)}")
    stage = 3 if stage3 else _stage(readers[join(optim[0][1])].tree)
    kind = "BF16_Optimizer (ZeRO 1 partitions)" if stage is None else f"ZeRO stage {stage}"
    view = CheckpointView(
        Format.DEEPSPEED,
        spec,
        ParallelLayout(dp=dp),
        tuple(files),
        int(states.get("global_steps", 0)),
        True,
        (f"DeepSpeed {kind}, fp32 masters", *notes),
        optimizer_step=steps.pop() if steps else None,
        frozen=tuple(sorted(entries[n][0] for n in frozen_shapes)),
        weights_are_masters=True,
    )
    items: list[tuple[KeyPath, Any, TorchZipReader]] = []
    groups: list[dict[str, Any]] = []
    if optim:
        first_optim = readers[join(optim[0][1])]
        items, groups = _optimizer_items(first_optim, param_shapes, entries, bool(stage3))
    shared = states.get("shared_params") or {}
    aliases = {
        (MODEL_KEY, alias): (MODEL_KEY, target)
        for alias, target in shared.items()
        if target in entries and alias not in entries
    }
    kept = {
        "param_shapes": param_shapes,
        "frozen_param_shapes": frozen_shapes,
        "shared_params": dict(shared),
        "skipped_steps": states.get("skipped_steps", 0),
        "global_samples": states.get("global_samples", 0),
    }
    if _plain(states.get("lr_scheduler")):  # a scheduler's state dict: numbers and lists
        kept["lr_scheduler"] = states.get("lr_scheduler")
    return DeepSpeedCheckpoint(storage, view, readers, items, aliases, groups, kept)


def _plain(value: Any) -> bool:
    """Built of Python's own containers and scalars only (safe to pickle again as it is)."""
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _optimizer_items(
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


def _optimizer_fragments(
    tree: Any, param_shapes: list[dict[str, Shape]], rank: int, dp: int, stage3: bool
) -> tuple[list[Fragment], FlatKeys]:
    """Where this rank's share of each trained parameter lies, and the flat tensors' keys."""
    osd = tree[OPTIMIZER_STATE]
    if stage3 != (_stage(tree) == 3):
        raise ValueError(
            f"saved by ZeRO stage {_stage(tree)}, beside "
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
    mappings = [{k: _address(v) for k, v in g.items()} for g in osd["param_slice_mappings"]]
    return fragments(param_shapes, mappings, rank, sizes), STAGE12_KEYS


def _stage3_frozen(
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


def _stage(tree: Any) -> int | None:
    """The ZeRO stage an optimizer file records; ``None`` for DeepSpeed's ``BF16_Optimizer``
    (bf16 with fp32 gradient accumulation), which partitions as ZeRO 1 does but says no stage."""
    stage = tree["optimizer_state_dict"].get("zero_stage")
    if stage is None:
        return None
    args = getattr(stage, "_args", None)
    return int(args[0]) if args else int(stage)


def _check_flat(tree: Any, group: int, flat: FlatKeys) -> None:
    master = resolve(tree, (*flat.masters, group))
    moments = resolve(tree, (*flat.moments, group))
    for state in ("exp_avg", "exp_avg_sq"):
        ref = moments.get(state)
        if not isinstance(ref, TensorRef) or len(ref.shape) != 1 or ref.shape[0] < master.shape[0]:
            raise ValueError(
                f"group {group} has no flat {state} covering its fp32 partition "
                "(elastic or foreign optimizer state); cannot map it"
            )


def _frozen_shapes(states: Any, param_shapes: list[dict[str, Shape]]) -> dict[str, Shape]:
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


def _frozen_keys(states: Any, frozen: dict[str, Shape]) -> dict[str, KeyPath]:
    """Where ZeRO 1/2 keep each frozen parameter whole: ``frozen_param_fragments`` (ZeRO 2) or
    the ``module``."""
    kept = states.get("frozen_param_fragments") or {}
    return {n: ("frozen_param_fragments", n) if n in kept else ("module", n) for n in frozen}


def _check_names(
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
