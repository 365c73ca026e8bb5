"""Read accelerate's ``save_state`` of an FSDP model saved with ``FULL_STATE_DICT``:
``pytorch_model_fsdp.bin`` (the whole model's state dict by HF name) and ``optimizer.bin``
(FSDP's full optimizer state dict, by parameter name), with the model's ``config.json``
beside them (the HF Trainer's ``checkpoint-N/``) or given by ``--hf-config``."""

from __future__ import annotations

from ckptctl import json_input
from ckptctl.errors import CheckpointError
from ckptctl.formats.accelerate.layout import MODEL, OPTIMIZER
from ckptctl.formats.base import ProbeRequest
from ckptctl.formats.hf_state_dict_files import (
    HfStateDictFiles,
    adapter_tensors,
    check_names,
    hf_model_view,
    model_tensors,
    optimizer_tensors,
    trainer_step,
)
from ckptctl.formats.options import ALLOW_ROUNDING, HF_CONFIG, TRUSTED_FIELDS
from ckptctl.formats.torchsave.refs import open_torch_file
from ckptctl.formats.transformers_model import build_names
from ckptctl.io.storage import Storage
from ckptctl.model.hf_layout import CONFIG
from ckptctl.model.hf_named import GENERATION_CONFIG
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.peft_wrapped import EmbeddedLora, split, wrapped
from ckptctl.model.stored import CheckpointView, StoredFile


def probe_accelerate(
    storage: Storage, names: frozenset[str], request: ProbeRequest
) -> HfStateDictFiles:
    given = request.get(HF_CONFIG)
    if given is not None:
        config = dict(given)
    elif storage.exists(CONFIG):
        config = json_input.parse_object(storage.read_text(CONFIG), storage.describe(CONFIG))
    else:
        raise CheckpointError(
            f"{storage.describe(MODEL)}: accelerate keeps no model config with it",
            hint="give the model's config.json with --hf-config",
        )
    generation = storage.read_text(GENERATION_CONFIG) if GENERATION_CONFIG in names else None
    model = build_names(config, storage.describe(CONFIG))
    readers = {MODEL: open_torch_file(storage, MODEL)}
    tree, where = readers[MODEL].tree, storage.describe(MODEL)
    peft = split(tree, where) if isinstance(tree, dict) and wrapped(tree) else None
    tensors = model_tensors(tree, model, where, 0, peft.base if peft else None)
    check_names({t.canonical for t in tensors}, model, storage.url)
    files = [StoredFile(MODEL, tuple(tensors))]
    adapter = None
    if peft is not None:  # the optimizer's state is the adapter's: not read
        names = names - {OPTIMIZER}
        base_model = config.get("_name_or_path")
        adapter = EmbeddedLora(
            (StoredFile(MODEL, tuple(adapter_tensors(tree, peft, where, 0))),),
            model.architecture,
            base_model if isinstance(base_model, str) and base_model else None,
            peft.adapter_name,
        )
    if OPTIMIZER in names:
        readers[OPTIMIZER] = open_torch_file(storage, OPTIMIZER)
        where = storage.describe(OPTIMIZER)
        state = optimizer_tensors(readers[OPTIMIZER].tree, model.parameters, where, 0)
        files.append(StoredFile(OPTIMIZER, tuple(state)))
    generic = CheckpointView(
        "accelerate",
        None,
        ParallelLayout(),
        tuple(files),
        trainer_step(storage),
        OPTIMIZER in names,
        (f"accelerate full state dict of {model.architecture}",),
    )
    view = hf_model_view(
        generic, model, config, generation, request.get(TRUSTED_FIELDS), storage.url
    )
    return HfStateDictFiles(
        storage, view, readers, adapter=adapter, rounding=request.get(ALLOW_ROUNDING)
    )
