"""Read verl's FSDP actor / critic checkpoints: every rank's ``torch.save`` of DTensor shards,
each shard placed where its placements put it in the global tensor, the optimizer's state
(numbered by parameter) named by the model's parameter order, which transformers gives from
the ``config.json`` verl saves in ``huggingface/``. A family ckptctl maps is read in its
canonical tensors (to HF, Megatron, ... with Adam state); any other architecture
transformers builds, by its HF names (to HF)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptctl import json_input
from ckptctl.errors import CheckpointError, CheckpointNotFoundError
from ckptctl.formats.base import Checkpoint, ProbeRequest
from ckptctl.formats.hf_state_dict_files import (
    HfStateDictFiles,
    adapter_tensors,
    check_names,
    hf_model_view,
    model_tensors,
    optimizer_tensors,
    with_state_names,
)
from ckptctl.formats.options import ALLOW_ROUNDING, HF_CONFIG, TRUSTED_FIELDS
from ckptctl.formats.torchsave.archive import TorchZipReader
from ckptctl.formats.torchsave.refs import open_torch_file
from ckptctl.formats.transformers_model import build_names
from ckptctl.formats.verl.layout import (
    ADAPTER_DIR,
    EXTRA,
    FSDP_CONFIG,
    HF_DIR,
    LORA_META,
    MODEL,
    model_file,
    optim_file,
    step_of,
    world_size,
)
from ckptctl.formats.verl.meshes import describe_mesh, held_mesh
from ckptctl.io.storage import Storage
from ckptctl.model.hf_layout import CONFIG
from ckptctl.model.hf_named import GENERATION_CONFIG
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.peft_wrapped import (
    EmbeddedLora,
    PeftNames,
    TrainedWith,
    split,
    trained_with,
    wrapped,
)
from ckptctl.model.stored import CheckpointView, StoredFile

VERL = "verl"


def _config(storage: Storage, request: ProbeRequest) -> tuple[dict[str, Any], str | None]:
    given = request.get(HF_CONFIG)
    if given is not None:
        return dict(given), None
    rel = f"{HF_DIR}/{CONFIG}"
    if not storage.exists(rel):
        raise CheckpointError(
            f"{storage.describe(rel)}: missing; verl saves the model's config there",
            hint="give the model's config.json with --hf-config",
        )
    config = json_input.parse_object(storage.read_text(rel), storage.describe(rel))
    generation = f"{HF_DIR}/{GENERATION_CONFIG}"
    return config, storage.read_text(generation) if storage.exists(generation) else None


def _check_fsdp_config(storage: Storage, world: int) -> None:
    if not storage.exists(FSDP_CONFIG):
        return
    where = storage.describe(FSDP_CONFIG)
    doc = json_input.parse_object(storage.read_text(FSDP_CONFIG), where)
    if doc.get("FSDP_version", 2) != 2:
        raise CheckpointError(
            f"{where}: FSDP_version {doc.get('FSDP_version')}: FSDP1's ShardedTensor files are "
            "not read (FSDP2's DTensor files are)"
        )
    if doc.get("world_size", world) != world:
        raise CheckpointError(
            f"{where}: world_size {doc.get('world_size')}, but the model files are of {world}"
        )


def probe_verl(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Checkpoint:
    if ADAPTER_DIR in names and not any(MODEL.fullmatch(n) for n in names):
        raise CheckpointError(
            f"{storage.url}: verl's Megatron actor trained with LoRA: {ADAPTER_DIR}/ holds the "
            "adapter only, not the model",
            hint=f"merge it into the model it was trained from: ckptctl merge-lora BASE "
            f"{storage.url} DST --lora-alpha A (or --adapter-only for a PEFT adapter)",
        )
    world = world_size(names, storage.url)
    _check_fsdp_config(storage, world)
    config, generation = _config(storage, request)
    model = build_names(config, storage.describe(f"{HF_DIR}/{CONFIG}"))
    readers: dict[str, TorchZipReader] = {}
    files, adapter_files = [], []
    peft: PeftNames | None = None
    alone = False
    for rank in range(world):
        rel = model_file(world, rank)
        if not storage.exists(rel):
            raise CheckpointNotFoundError(f"{storage.describe(rel)}: missing (world size {world})")
        readers[rel] = open_torch_file(storage, rel)
        tree, where = readers[rel].tree, storage.describe(rel)
        if rank == 0 and isinstance(tree, dict) and wrapped(tree):
            peft = split(tree, where)
        if peft is not None:
            adapter_files.append(StoredFile(rel, tuple(adapter_tensors(tree, peft, where, rank))))
        if alone := peft is not None and not peft.base:
            continue  # verl's save_lora_only: the adapter without its base
        tensors = model_tensors(tree, model, where, rank, peft.base if peft else None)
        files.append(StoredFile(rel, tuple(tensors)))
    if not alone:
        check_names({t.canonical for f in files for t in f.tensors}, model, storage.url)
    # A LoRA run's optimizer numbers the wrapped model's parameters (base and adapter): its
    # state belongs to the adapter, which merge-lora writes without it.
    with_optimizer = peft is None and all(
        storage.exists(optim_file(world, r)) for r in range(world)
    )
    for rank in range(world) if with_optimizer else ():
        rel = optim_file(world, rank)
        readers[rel] = open_torch_file(storage, rel)
        where = storage.describe(rel)
        optimizer = optimizer_tensors(readers[rel].tree, model.parameters, where, rank)
        files.append(StoredFile(rel, tuple(optimizer)))
    mesh = held_mesh(files, world)
    on = f", {describe_mesh(mesh)}" if mesh is not None and len(mesh) == 2 else ""
    notes = [f"verl FSDP checkpoint of {model.architecture}: {world} ranks{on}"]
    if peft is not None:
        notes.append(
            f"trained with LoRA adapter {peft.adapter_name!r} on {len(peft.modules)} modules "
            "(its optimizer state not read)"
            + ("; saved alone (save_lora_only): no base weights" if alone else "")
        )
    generic = CheckpointView(
        VERL,
        None,
        ParallelLayout(),
        tuple(files),
        step_of(storage.url),
        with_optimizer,
        tuple(notes),
    )
    view = hf_model_view(
        generic, model, config, generation, request.get(TRUSTED_FIELDS), storage.url
    )
    # By stored name, the world size as its layout, the files held beside the tensors: what
    # a verl target at another world size is cut from (``ckptctl.formats.verl.target``).
    beside = [rel for rel in storage.find_files() if _carried(rel, world)]
    named = with_state_names(generic)
    by_name = replace(
        named,
        layout=ParallelLayout(dp=world),
        files=(*named.files, *(StoredFile(rel, ()) for rel in sorted(beside))),
    )
    adapter = None
    if peft is not None:
        base_model = config.get("_name_or_path")
        adapter = EmbeddedLora(
            tuple(adapter_files),
            model.architecture,
            base_model if isinstance(base_model, str) and base_model else None,
            peft.adapter_name,
            trained=_lora_meta(storage),
            alone=alone,
        )
    rounding = request.get(ALLOW_ROUNDING)
    return HfStateDictFiles(
        storage, view, readers, adapter=adapter, by_name=by_name, rounding=rounding
    )


def _carried(rel: str, world: int) -> bool:
    """A file a resumed run reads beside the tensors: RNG and scheduler state, the model's
    config and tokenizer."""
    extra = EXTRA.fullmatch(rel)
    return rel.startswith(f"{HF_DIR}/") or (extra is not None and int(extra[1]) == world)


def _lora_meta(storage: Storage) -> TrainedWith | None:
    """verl (0.9) records a LoRA run's rank and alpha beside its files."""
    if not storage.exists(LORA_META):
        return None
    where = storage.describe(LORA_META)
    return trained_with(json_input.parse_object(storage.read_text(LORA_META), where), where)
