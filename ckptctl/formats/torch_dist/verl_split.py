"""verl 0.9's split Megatron layout (``MegatronCheckpointManager``, layout schema 2): rank 0
writes ``ckpt_contents.json`` last, naming where each piece of the save went: the model's
``torch_dist`` directory (``model/dist_ckpt``, with ``use_dist_checkpointing``) or its HF
weights (``model/huggingface``, written by Megatron-Bridge), the optimizer's and scheduler's
(``optimizer/dist_ckpt``), the RNG state's (``extra/dist_ckpt``) and ``transformer_config.json``.

The model's and the optimizer's directories are one state dict saved apart (the optimizer's
keys name the model's parameters), so they are read as one ``torch_dist`` checkpoint, the model
described as for verl's single-directory layout (``verl_actor``); a save whose weights went
to HF safetensors has them read from there and joined with the optimizer's directory
(``verl_actor.apart_from_weights``, ``joined``). Paths in the manifest are the checkpoint's
own and are refused if they leave it."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from ckptctl import json_input
from ckptctl.errors import CheckpointError
from ckptctl.formats.base import ProbeRequest
from ckptctl.formats.megatron_common.iterations import mcore_backend
from ckptctl.formats.megatron_common.options import ITERATION, TRUE_VOCAB_SIZE
from ckptctl.formats.options import TRUSTED_FIELDS
from ckptctl.formats.torch_dist.checkpoint import TorchDistCheckpoint
from ckptctl.formats.torch_dist.reader import probe_torch_dist
from ckptctl.formats.torch_dist.verl_actor import apart_from_weights, described, hf_config
from ckptctl.io.storage import Storage
from ckptctl.model.hf_layout import CONFIG

CONTENTS = "ckpt_contents.json"
SCHEMA = 2
"""verl's ``MANIFEST_SCHEMA_VERSION`` of the layout read here."""
DIST = "megatron_dist_checkpoint"
HF = "huggingface"
HF_DIR = "model/huggingface"
"""Where verl puts the HF config (and Megatron-Bridge the HF weights) in this layout."""


def recognised(names: frozenset[str]) -> bool:
    """verl's Megatron manifest (its FSDP checkpoints, which have none, are the ``verl``
    format's)."""
    return CONTENTS in names and not any(n.startswith("model_world_size_") for n in names)


def probe_split(storage: Storage, request: ProbeRequest) -> TorchDistCheckpoint:
    where = storage.describe(CONTENTS)
    manifest = json_input.parse_object(storage.read_text(CONTENTS), where)
    if manifest.get("schema_version") != SCHEMA:
        raise CheckpointError(
            f"{where}: schema_version {manifest.get('schema_version')!r}; ckptctl reads verl's "
            f"Megatron layout of schema {SCHEMA} (verl 0.9)",
            hint="is this a verl Megatron checkpoint? verl's FSDP checkpoints have no manifest",
        )
    contents = manifest.get("contents")
    if not isinstance(contents, dict):
        raise CheckpointError(f"{where}: 'contents' is not an object naming what was saved")
    backend = manifest.get("backend")
    backend = backend if isinstance(backend, dict) else {}
    lora = bool(backend.get("peft") or "peft_adapters" in contents)
    model_entry = _entry(contents, "model", where) or {}
    if lora and model_entry.get("format") != DIST:
        exported = model_entry.get("peft_adapter_path")
        field = "model.peft_adapter_path"
        adapter = (
            f"{storage.url.rstrip('/')}/{_inside(storage, exported, field, where)}"
            if isinstance(exported, str)
            else f"the PEFT adapter verl exports under {HF_DIR}/adapter (Megatron-Bridge on)"
        )
        raise CheckpointError(
            f"{where}: a LoRA run (backend.peft) whose base was saved as HF safetensors and "
            "its adapter's shards in model/dist_ckpt apart, which ckptctl does not read "
            "together yet",
            hint=f"merge {adapter} into the model the run started from: ckptctl merge-lora "
            "BASE ADAPTER DST",
        )
    model = _entry(contents, "model", where)
    if model is None:
        raise CheckpointError(
            f"{where}: saved without the model (save_contents "
            f"{manifest.get('save_contents')!r}): there are no weights to convert"
        )
    step = manifest.get("global_step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    # A LoRA run's optimizer holds the adapter's state alone, which merge-lora does not need.
    optimizer = None if lora else _entry(contents, "optimizer", where)
    opt_dir = None if optimizer is None else _dist_dir(storage, optimizer, "optimizer", where)
    if model.get("format") == HF:
        # The weights as HF safetensors, the optimizer's torch_dist shards apart: the latter
        # opened alone here, joined with the former by the caller (``WeightsElsewhere``).
        weights = _path(storage, model, "model", where)
        apart_from_weights(
            storage,
            weights,
            opt_dir,
            step,
            None
            if opt_dir is None
            else partial(
                _probe_parts, storage, request, manifest, where, step, [opt_dir], contents
            ),
        )
    parts = [_dist_dir(storage, model, "model", where)]
    parts += [opt_dir] if opt_dir is not None and opt_dir not in parts else []
    return _probe_parts(storage, request, manifest, where, step, parts, contents, lora=lora)


def _probe_parts(
    storage: Storage,
    request: ProbeRequest,
    manifest: dict[str, Any],
    where: str,
    step: int | None,
    parts: list[str],
    contents: dict[str, Any],
    *,
    lora: bool = False,
) -> TorchDistCheckpoint:
    """The ``torch_dist`` directories ``parts`` read as one checkpoint of the run the
    manifest and the HF config describe."""
    warnings = []
    rng = _entry(contents, "rng_state", where)
    if rng is not None:
        warnings.append(
            f"not carried: rng_state ({_path(storage, rng, 'rng_state', where)}/, pickled objects)"
        )
    config, config_from = _config(storage, request, manifest, where)
    run = described(storage, config, request, config_from, step)
    run = replace(run, parts=tuple(parts), warnings=tuple(warnings), lora=lora)
    return probe_torch_dist(
        storage,
        "",
        request.get(ITERATION),
        request.get(TRUE_VOCAB_SIZE),
        request.get(TRUSTED_FIELDS),
        run,
    )


def _entry(contents: dict[str, Any], name: str, where: str) -> dict[str, Any] | None:
    entry = contents.get(name)
    if entry is not None and not isinstance(entry, dict):
        raise CheckpointError(f"{where}: contents.{name} is not an object")
    return entry


def _path(storage: Storage, entry: dict[str, Any], name: str, where: str) -> str:
    """The entry's directory, relative to the checkpoint; refused if it leaves it."""
    return _inside(storage, entry.get("path"), f"{name}.path", where)


def _inside(storage: Storage, path: Any, field: str, where: str) -> str:
    if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
        raise CheckpointError(
            f"{where}: contents.{field} is {path!r}, not a directory inside the checkpoint"
        )
    storage.path(path)  # refuses a path escaping the root however spelt
    return path.rstrip("/")


def _dist_dir(storage: Storage, entry: dict[str, Any], name: str, where: str) -> str:
    """A ``megatron_dist_checkpoint`` entry's ``torch_dist`` directory."""
    if entry.get("format") != DIST:
        raise CheckpointError(
            f"{where}: contents.{name} is of format {entry.get('format')!r}; ckptctl reads "
            f"{DIST!r} there"
        )
    path = _path(storage, entry, name, where)
    backend = mcore_backend(storage, path)
    if backend != "torch_dist":
        raise CheckpointError(
            f"{storage.describe(path)}: sharded backend {backend!r}, not torch_dist (a "
            "Megatron-FSDP run's combined checkpoint is not read)"
            if backend
            else f"{storage.describe(path)}: missing or incomplete (no metadata.json), though "
            f"{CONTENTS} names it"
        )
    return path


def _config(
    storage: Storage, request: ProbeRequest, manifest: dict[str, Any], where: str
) -> tuple[dict[str, Any], str]:
    """The HF config the model is read from (``hf_config``: given, or the one verl saved with
    Megatron-Bridge); without either, refused naming the model."""
    rel = f"{HF_DIR}/{CONFIG}"
    found = hf_config(storage, request, rel)
    if found is not None:
        return found
    arch = manifest.get("arch")
    raise CheckpointError(
        f"{where}: verl saved no HF config with this checkpoint ({rel} is missing"
        + (f"; the model is a {arch}" if isinstance(arch, str) else "")
        + ")",
        hint="give the config.json of the model the run started from with --hf-config",
    )
