"""Reading DeepSpeed universal checkpoints (``ds_to_universal``'s or ckptctl's): every
parameter's fp32 weight and Adam state whole, one ``torch.save`` file each under
``<tag>/zero/<HF name>/``; the model is the HF one ``config.json`` (or ``--hf-config``)
describes, as for ZeRO checkpoints."""

from __future__ import annotations

from math import prod
from typing import Any

from ckptctl.errors import CheckpointError, CheckpointNotFoundError, LayoutError
from ckptctl.formats.base import ProbeRequest
from ckptctl.formats.deepspeed.layout import (
    LATEST_UNIVERSAL,
    OPTIMIZER_STATE,
    PARAM_KEY,
    UNIVERSAL_MODEL_STATES,
    UNIVERSAL_OPTIMIZER_STATE,
    UNIVERSAL_STATES,
    UNIVERSAL_ZERO,
)
from ckptctl.formats.deepspeed.options import TAG
from ckptctl.formats.deepspeed.reader import model_config, tag_dir
from ckptctl.formats.options import TRUSTED_FIELDS
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.formats.torchsave.refs import TorchFiles, open_torch_file, resolve
from ckptctl.io.storage import Storage
from ckptctl.model.catalog import state_name
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.hf_config import spec_from_config
from ckptctl.model.hf_layout import CONFIG, per_name_tensors
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.stored import (
    CheckpointView,
    Format,
    KeyPath,
    Shape,
    StoredFile,
    StoredTensor,
)


class UniversalCheckpoint(TorchFiles):
    """A universal checkpoint: one ``torch.save`` file per parameter and state."""


def probe_universal(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    tag = tag_dir(
        storage, names, request.get(TAG), LATEST_UNIVERSAL, lambda listed: UNIVERSAL_ZERO in listed
    )

    def join(name: str) -> str:
        return f"{tag}/{name}" if tag else name

    try:
        config = model_config(storage, request, tag)  # required: never None
        assert config is not None
        spec = spec_from_config(config, 128, request.get(TRUSTED_FIELDS))
    except LayoutError as err:
        raise LayoutError(f"{storage.describe(CONFIG)}: {err}") from None
    entries = {
        hf: (canonical, shape, pieces)
        for hf, canonical, shape, pieces in per_name_tensors(spec, "DeepSpeed universal")
    }
    zero = join(UNIVERSAL_ZERO)
    listed = {n for n in storage.listdir(zero) if storage.isdir(f"{zero}/{n}")}
    tied = {"lm_head.weight"} if spec.tie_embeddings else set()  # ds_to_universal writes it
    unknown, missing = sorted(listed - set(entries) - tied), sorted(set(entries) - listed)
    problems = []
    if unknown:
        problems.append(f"parameters the model config does not have: {', '.join(unknown[:5])}")
    if missing:
        # ds_to_universal leaves out the frozen parameters of ZeRO 3 runs
        problems.append(f"no folder for {', '.join(missing[:5])}")
    if problems:
        raise CheckpointError(f"{storage.describe(zero)}: " + "; ".join(problems))
    readers: dict[str, TorchZipReader] = {}
    files: list[StoredFile] = []
    steps: set[float] = set()
    frozen: list[str] = []
    for hf, (canonical, shape, pieces) in entries.items():
        folder = f"{zero}/{hf}"
        present = set(storage.listdir(folder))
        for state in UNIVERSAL_STATES:
            rel = f"{folder}/{state}.pt"
            if f"{state}.pt" not in present:
                if state == "fp32":
                    raise CheckpointNotFoundError(f"{storage.describe(rel)}: missing")
                continue
            reader = readers[rel] = open_torch_file(storage, rel)
            key, ref = _param(reader, storage.describe(rel), shape)
            name = canonical if state == "fp32" else state_name(state, canonical)
            offset = None if tuple(ref.shape) == tuple(shape) else 0
            tensor = StoredTensor(
                key, name, shape, dtype_name(ref.dtype), pieces, view_offset=offset
            )
            files.append(StoredFile(rel, (tensor,)))
        if "exp_avg.pt" not in present:
            frozen.append(canonical)
        if "step.pt" in present:
            rel = f"{folder}/step.pt"
            steps.add(_number(open_torch_file(storage, rel), (), storage.describe(rel)))
    has_optimizer = len(frozen) < len(entries)
    if has_optimizer and not steps:
        # ZeRO 3's universal files keep Adam's step in the optimizer's global state only.
        rel = join(UNIVERSAL_OPTIMIZER_STATE)
        if storage.exists(rel):
            key = (OPTIMIZER_STATE, "state", 0, "step")
            steps.add(_number(open_torch_file(storage, rel), key, storage.describe(rel)))
    if len(steps) > 1:
        raise CheckpointError(f"{storage.describe(zero)}: parameters at Adam steps {sorted(steps)}")
    iteration = None
    states = next((join(n) for n in UNIVERSAL_MODEL_STATES if storage.exists(join(n))), None)
    if states is not None:
        iteration = int(open_torch_file(storage, states).tree.get("global_steps", 0))
    view = CheckpointView(
        Format.DEEPSPEED_UNIVERSAL,
        spec,
        ParallelLayout(),
        tuple(files),
        iteration,
        has_optimizer,
        ("DeepSpeed universal checkpoint, fp32 weights",),
        optimizer_step=steps.pop() if steps else None,
        frozen=tuple(sorted(frozen)) if has_optimizer else (),
    )
    return UniversalCheckpoint(storage, view, readers)


def _param(reader: TorchZipReader, where: str, shape: Shape) -> tuple[KeyPath, TensorRef]:
    """The tensor of a state file: ``{"param": tensor}``, or the bare tensor (ZeRO 3), whole
    or flat."""
    key: KeyPath = PARAM_KEY if isinstance(reader.tree, dict) else ()
    try:
        ref = resolve(reader.tree, key)
    except (KeyError, TypeError):
        ref = None
    if not isinstance(ref, TensorRef):
        raise CheckpointError(f"{where}: no tensor under 'param'")
    whole = tuple(ref.shape) == tuple(shape)
    if not whole and (len(ref.shape) != 1 or prod(ref.shape) != prod(shape)):
        raise CheckpointError(f"{where}: shape {list(ref.shape)}, the model's is {list(shape)}")
    return key, ref


def _number(reader: TorchZipReader, key: KeyPath, where: str) -> float:
    value = resolve(reader.tree, key)
    if isinstance(value, TensorRef):
        return reader.read_number(value)
    if isinstance(value, int | float):
        return float(value)
    raise CheckpointError(f"{where}: Adam's step is not a number")
