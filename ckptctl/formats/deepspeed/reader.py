"""Reading DeepSpeed ZeRO checkpoints: ``latest`` (or ``--tag``) names the tag directory. Stages
1 and 2 keep ``mp_rank_00_model_states.pt`` (16-bit module, ``param_shapes``, frozen parameters,
tied aliases) and one ``[bf16_]zero_pp_rank_<dp>_mp_rank_00_optim_states.pt`` per DP rank (fp32
masters and Adam moments of its flat partitions); stage 3 a model-states file per rank too, with
its share of the frozen parameters. The fp32 masters are the weights; frozen parameters come
from the model states. The model is the HF one ``config.json`` (beside the checkpoint, or
``--hf-config``) describes."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptctl import json_input
from ckptctl.errors import CheckpointError, CheckpointNotFoundError, LayoutError
from ckptctl.formats.base import ProbeRequest, SavedTraining
from ckptctl.formats.deepspeed.layout import (
    LATEST,
    MODEL_STATES,
    OPTIM_STATES,
    STAGE3_MODEL_STATES,
    fragment_tensors,
    holds_model_states,
)
from ckptctl.formats.deepspeed.options import TAG
from ckptctl.formats.deepspeed.partitions import (
    check_flat,
    check_names,
    frozen_keys,
    frozen_shapes,
    optimizer_fragments,
    optimizer_items,
    plain,
    stage3_frozen,
    zero_stage,
)
from ckptctl.formats.options import HF_CONFIG, TRUSTED_FIELDS
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.formats.torchsave.refs import TorchFiles, open_torch_file, resolve
from ckptctl.io.storage import Storage
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.geometry import Piece, Shape, whole
from ckptctl.model.hf_config import spec_from_config
from ckptctl.model.hf_layout import CONFIG, MODEL_KEY, per_name_tensors
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.megatron_style import GroupOrder, MegatronStyle, OptimizerLayout
from ckptctl.model.stored import (
    CheckpointView,
    Format,
    KeyPath,
    StoredFile,
    StoredTensor,
)


@dataclass
class DeepSpeedCheckpoint(TorchFiles):
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
    given = request.get(HF_CONFIG)
    if given is not None:
        return dict(given)
    if not storage.exists(CONFIG):
        if not required:
            return None
        where = storage.describe(CONFIG)
        raise CheckpointError(
            f"{where}: missing, so the model is unknown; pass --hf-config CONFIG.json"
            + (" (the checkpoint was given as its tag directory)" if not tag else "")
        )
    return json_input.parse_object(storage.read_text(CONFIG), storage.describe(CONFIG))


def _ranked(listing: set[str], pattern: re.Pattern[str], group: int) -> list[tuple[int, str]]:
    return sorted((int(m.group(group)), n) for n in listing if (m := pattern.match(n)))


def probe_deepspeed(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    tag = tag_dir(storage, names, request.get(TAG))

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
    held_frozen = frozen_shapes(states, param_shapes)
    config = model_config(storage, request, tag, required=False)
    notes = []
    if config is None:
        # No model description: every parameter whole under its own name, which is all a
        # torch state dict (or a universal checkpoint) needs.
        spec = None
        entries: dict[str, tuple[str, Shape, tuple[Piece, ...]]] = {
            name: (name, shape, (whole(shape),))
            for group in (*param_shapes, held_frozen)
            for name, shape in group.items()
        }
        notes.append(
            f"{storage.describe(CONFIG)} missing: tensors keep DeepSpeed's names (--format torch "
            "or deepspeed-universal); pass --hf-config CONFIG.json for HF and Megatron targets"
        )
    else:
        try:
            spec = spec_from_config(config, 128, request.get(TRUSTED_FIELDS))
        except LayoutError as err:
            raise LayoutError(f"{storage.describe(CONFIG)}: {err}") from None
        entries = {
            hf: (c, shape, pieces) for hf, c, shape, pieces in per_name_tensors(spec, "DeepSpeed")
        }
        check_names(entries, param_shapes, held_frozen, states, storage.describe(first))

    files: list[StoredFile] = []
    steps: set[float] = set()
    for rank, name in optim:
        rel = join(name)
        reader = readers[rel] = open_torch_file(storage, rel)
        tensors: list[StoredTensor] = []
        try:
            frags, flat = optimizer_fragments(reader.tree, param_shapes, rank, dp, bool(stage3))
            for frag in frags:
                canonical, shape, pieces = entries[frag.name]
                tensors += fragment_tensors(frag, shape, canonical, pieces, flat)
            for g in range(len(resolve(reader.tree, flat.masters))):
                check_flat(reader.tree, g, flat)
                step = resolve(reader.tree, (*flat.moments, g)).get("step")
                steps.add(reader.read_number(step) if isinstance(step, TensorRef) else step)
        except ValueError as err:
            raise CheckpointError(f"{storage.describe(rel)}: {err}") from None
        files.append(StoredFile(rel, tuple(tensors)))
    steps.discard(None)
    if stage3:
        for rank, name in stage3:
            rel = join(name)
            if rel not in readers:  # rank 0's is open already
                readers[rel] = open_torch_file(storage, rel)
            reader = readers[rel]
            frozen = stage3_frozen(reader.tree, held_frozen, entries, rank, dp, rel, storage)
            files.insert(rank, StoredFile(rel, tuple(frozen)))
    else:
        frozen = []
        for hf, key in frozen_keys(states, held_frozen).items():
            canonical, shape, pieces = entries[hf]
            dtype = dtype_name(resolve(states, key).dtype)
            frozen.append(StoredTensor(key, canonical, shape, dtype, pieces))
        files.insert(0, StoredFile(first, tuple(frozen)))
    files = [f for f in files if f.tensors]
    if len(steps) > 1:
        raise CheckpointError(f"{where}: parameter groups at different Adam steps {sorted(steps)}")
    stage = 3 if stage3 else zero_stage(readers[join(optim[0][1])].tree)
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
        frozen=tuple(sorted(entries[n][0] for n in held_frozen)),
        weights_are_masters=True,
    )
    items: list[tuple[KeyPath, Any, TorchZipReader]] = []
    groups: list[dict[str, Any]] = []
    if optim:
        first_optim = readers[join(optim[0][1])]
        items, groups = optimizer_items(first_optim, param_shapes, entries, bool(stage3))
    shared = states.get("shared_params") or {}
    aliases: dict[KeyPath, KeyPath] = {
        (MODEL_KEY, alias): (MODEL_KEY, target)
        for alias, target in shared.items()
        if target in entries and alias not in entries
    }
    kept = {
        "param_shapes": param_shapes,
        "frozen_param_shapes": held_frozen,
        "shared_params": dict(shared),
        "skipped_steps": states.get("skipped_steps", 0),
        "global_samples": states.get("global_samples", 0),
    }
    if plain(states.get("lr_scheduler")):  # a scheduler's state dict: numbers and lists
        kept["lr_scheduler"] = states.get("lr_scheduler")
    return DeepSpeedCheckpoint(storage, view, readers, items, aliases, groups, kept)
