"""Reading DeepSpeed ZeRO stage 1/2 checkpoints: ``latest`` names the tag directory, which holds
``mp_rank_00_model_states.pt`` (16-bit module, ``param_shapes``, frozen parameters, tied aliases)
and one ``zero_pp_rank_<dp>_mp_rank_00_optim_states.pt`` per DP rank (fp32 masters and Adam
moments of its flat partitions). The fp32 masters are the weights; frozen parameters come from
the model states. The model is the HF one ``config.json`` (beside the checkpoint, or
``--hf-config``) describes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ckptctl.errors import CheckpointError, CheckpointNotFoundError, LayoutError
from ckptctl.formats.base import ProbeRequest
from ckptctl.formats.deepspeed.layout import (
    LATEST,
    MASTERS,
    MODEL_STATES,
    MOMENTS,
    OPTIM_STATES,
    STAGE3_MODEL_STATES,
    fragment_tensors,
    fragments,
)
from ckptctl.formats.hf.families import spec_from_config
from ckptctl.formats.hf.layout import CONFIG, hf_tensors
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.formats.torchsave.refs import open_torch_file, read_box, resolve
from ckptctl.model.dtypes import dtype_name
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

    def read(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> torch.Tensor:
        return read_box(self.readers[path], key, offsets, sizes, view)


def _tag_dir(storage: Storage, names: frozenset[str]) -> str:
    """The tag directory, relative to the root: the one ``latest`` names, or the root itself."""
    if any(MODEL_STATES.match(n) for n in names):
        return ""
    tag = storage.read_text(LATEST).strip()
    if not tag or "/" in tag or tag in (".", ".."):
        raise CheckpointError(f"{storage.describe(LATEST)}: {tag!r} is not a tag directory name")
    if not storage.isdir(tag):
        raise CheckpointNotFoundError(
            f"{storage.describe(tag)}: the tag {LATEST} names does not exist"
        )
    return tag


def _config(storage: Storage, request: ProbeRequest, tag: str) -> dict[str, Any]:
    if request.hf_config is not None:
        return dict(request.hf_config)
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


def probe_deepspeed(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    tag = _tag_dir(storage, names)

    def join(name: str) -> str:
        return f"{tag}/{name}" if tag else name

    listing = set(storage.listdir(tag)) if tag else set(names)
    where = storage.describe(tag)
    if any(STAGE3_MODEL_STATES.match(n) for n in listing):
        raise CheckpointError(f"{where}: a ZeRO stage 3 checkpoint: not supported yet")
    model_files = sorted(n for n in listing if MODEL_STATES.match(n))
    optim = sorted(
        (n for n in listing if OPTIM_STATES.match(n)),
        key=lambda n: int(OPTIM_STATES.match(n).group(2)),  # type: ignore[union-attr]
    )
    if len(model_files) != 1:
        raise CheckpointError(
            f"{where}: {len(model_files)} model-parallel ranks; only mp_rank_00 (no TP/PP) is "
            "supported"
        )
    readers = {join(model_files[0]): open_torch_file(storage, join(model_files[0]))}
    states = readers[join(model_files[0])].tree
    dp = int(states.get("dp_world_size", 0))
    ranks = [int(OPTIM_STATES.match(n).group(2)) for n in optim]  # type: ignore[union-attr]
    if ranks != list(range(dp)):
        raise CheckpointNotFoundError(
            f"{where}: optimizer files for DP ranks {ranks}, but dp_world_size={dp}; a rank "
            "file is missing or foreign"
        )
    config = _config(storage, request, tag)
    try:
        spec = spec_from_config(config, 128, request.trusted_fields)
    except LayoutError as err:
        raise LayoutError(f"{storage.describe(CONFIG)}: {err}") from None
    entries = {hf: (canonical, shape, pieces) for hf, canonical, shape, pieces in hf_tensors(spec)}
    param_shapes = [{k: tuple(v) for k, v in g.items()} for g in states["param_shapes"]]
    frozen_at = _frozen(states, param_shapes)
    _check_names(entries, param_shapes, frozen_at, states, storage.describe(join(model_files[0])))

    files: list[StoredFile] = []
    steps: set[float] = set()
    for name in optim:
        rel = join(name)
        reader = readers[rel] = open_torch_file(storage, rel)
        osd = reader.tree["optimizer_state_dict"]
        if "param_slice_mappings" not in osd or "single_partition_of_fp32_groups" not in osd:
            # bf16 ZeRO 1/2 runs keep the ZeRO keys under a bf16_ file name; DeepSpeed's
            # BF16_Optimizer (e.g. Megatron-DeepSpeed) keeps others.
            raise CheckpointError(
                f"{storage.describe(rel)}: no ZeRO partitions (single_partition_of_fp32_groups, "
                "param_slice_mappings): DeepSpeed's BF16_Optimizer state is not supported yet"
            )
        masters = osd["single_partition_of_fp32_groups"]
        paddings = osd.get("group_paddings", [0] * len(masters))
        sizes = [m.shape[0] + pad for m, pad in zip(masters, paddings, strict=True)]
        mappings = [{k: _address(v) for k, v in g.items()} for g in osd["param_slice_mappings"]]
        rank = int(OPTIM_STATES.match(name).group(2))  # type: ignore[union-attr]
        try:
            frags = fragments(param_shapes, mappings, rank, sizes)
        except ValueError as err:
            raise CheckpointError(f"{storage.describe(rel)}: {err}") from None
        tensors: list[StoredTensor] = []
        for frag in frags:
            canonical, shape, pieces = entries[frag.name]
            tensors += fragment_tensors(frag, shape, canonical, pieces)
        for g in range(len(masters)):
            step = resolve(reader.tree, (*MOMENTS, g)).get("step")
            if isinstance(step, TensorRef):
                steps.add(float(reader.read(step).item()))
            elif step is not None:
                steps.add(float(step))
            _check_flat(reader.tree, g, storage.describe(rel))
        files.append(StoredFile(rel, tuple(tensors)))
    frozen = []
    for hf, key in frozen_at.items():
        canonical, shape, pieces = entries[hf]
        dtype = dtype_name(resolve(states, key).dtype)
        frozen.append(StoredTensor(key, canonical, shape, dtype, pieces))
    if frozen:
        files.insert(0, StoredFile(join(model_files[0]), tuple(frozen)))
    if len(steps) > 1:
        raise CheckpointError(f"{where}: parameter groups at different Adam steps {sorted(steps)}")
    view = CheckpointView(
        Format.DEEPSPEED,
        spec,
        ParallelLayout(dp=dp),
        tuple(files),
        int(states.get("global_steps", 0)),
        True,
        (f"DeepSpeed ZeRO stage {_stage(readers[join(optim[0])].tree)}, fp32 masters",),
        optimizer_step=steps.pop() if steps else None,
        frozen=tuple(sorted({t.canonical for t in frozen})),
    )
    return DeepSpeedCheckpoint(storage, view, readers)


def _stage(tree: Any) -> int:
    stage = tree["optimizer_state_dict"].get("zero_stage")
    args = getattr(stage, "_args", None)
    return int(args[0]) if args else int(stage)


def _check_flat(tree: Any, group: int, where: str) -> None:
    master = resolve(tree, (*MASTERS, group))
    moments = resolve(tree, (*MOMENTS, group))
    for state in ("exp_avg", "exp_avg_sq"):
        ref = moments.get(state)
        if not isinstance(ref, TensorRef) or len(ref.shape) != 1 or ref.shape[0] < master.shape[0]:
            raise CheckpointError(
                f"{where}: group {group} has no flat {state} covering its fp32 partition "
                "(elastic or foreign optimizer state); cannot map it"
            )


def _frozen(states: Any, param_shapes: list[dict[str, Shape]]) -> dict[str, KeyPath]:
    """Where each frozen parameter is kept: ``frozen_param_fragments`` (ZeRO 2), or only the
    16-bit ``module`` (ZeRO 1 records no frozen parameters; ``zero_to_fp32`` drops them)."""
    fragments = states.get("frozen_param_fragments")
    if fragments:
        return {name: ("frozen_param_fragments", name) for name in fragments}
    trained = {name for group in param_shapes for name in group}
    skip = set((states.get("shared_params") or {}).keys()) | set(states.get("buffer_names") or ())
    module = states.get("module") or {}
    return {
        name: ("module", name)
        for name, ref in module.items()
        if isinstance(ref, TensorRef) and name not in trained and name not in skip
    }


def _check_names(
    entries: dict[str, Any],
    param_shapes: list[dict[str, Shape]],
    frozen: dict[str, KeyPath],
    states: Any,
    where: str,
) -> None:
    """Every parameter the HF model has is trained, frozen or a tied alias, with its shape."""
    held = {name: shape for group in param_shapes for name, shape in group.items()}
    held.update({name: tuple(resolve(states, key).shape) for name, key in frozen.items()})
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
