"""HF safetensors of a model ckptctl has no family table for (a VLM, a new family): every
tensor its own canonical tensor by name, checked against the model transformers builds from
the ``config.json`` (each tensor there, of its shape; nothing the model has no place for), the
config carried. Such a checkpoint converts to HF (another dtype, other shard sizes), to one
torch file, and is compared by ``verify --against`` name for name."""

from __future__ import annotations

import json
from typing import Any

from ckptctl import json_input
from ckptctl.errors import CheckpointError
from ckptctl.formats.hf import mxfp4
from ckptctl.formats.hf.fp8 import QUANTIZATION
from ckptctl.formats.safetensors_header import SafetensorsEntry, read_header
from ckptctl.formats.transformers_model import build_names
from ckptctl.io.storage import Storage
from ckptctl.model.geometry import whole
from ckptctl.model.hf_layout import CONFIG, INDEX, SINGLE
from ckptctl.model.hf_named import GENERATION_CONFIG, HfNamedSource
from ckptctl.model.hf_text_backbone import text_only_hint
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.stored import CheckpointView, Format, Replica, StoredFile, StoredTensor


def _headers(storage: Storage) -> dict[str, dict[str, SafetensorsEntry]]:
    """Every safetensors file's header, by the index (or the one file)."""
    if storage.exists(INDEX):
        where = storage.describe(INDEX)
        index = json_input.parse_object(storage.read_text(INDEX), where)
        weight_map = json_input.field(index, "weight_map", dict, f"{where}: malformed index")
        paths = sorted({str(p) for p in weight_map.values()})
    else:
        weight_map, paths = None, [SINGLE]
    headers = {}
    for path in paths:
        storage.path(path)  # refuses paths escaping the root before anything is opened
        with storage.open_read(path) as f:
            headers[path] = read_header(f, storage.describe(path), storage.size(path)).tensors
    if weight_map is not None:
        for name, path in weight_map.items():
            if name not in headers[path]:
                raise CheckpointError(f"{storage.describe(path)}: tensor {name} missing")
    return headers


Packed = dict[tuple[str, str], tuple[tuple[str, str], tuple[str, str]]]
"""MXFP4 tensors by (file, in-memory name): (file, name) of their blocks and of their scales."""


def probe_named(
    storage: Storage, config: dict[str, Any], why: str
) -> tuple[CheckpointView, Any, Packed]:
    """The view of an HF checkpoint of any architecture transformers builds, its headers, and
    its MXFP4 tensors (read dequantized)."""
    where = storage.describe(CONFIG)
    dequantized = mxfp4.is_mxfp4(config)
    if dequantized:
        mxfp4.check_config(config, where)
        # what the model is, and what is written: the weights as they are read
        config = {k: v for k, v in config.items() if k != QUANTIZATION}
    elif QUANTIZATION in config:
        raise CheckpointError(
            f"{where}: quantized weights ({QUANTIZATION}) are read for the families ckptctl "
            "maps, and MXFP4 experts (GPT-OSS), only"
        )
    model = build_names(config, where)
    headers = _headers(storage)
    held = {
        name: (path, entry) for path, tensors in headers.items() for name, entry in tensors.items()
    }
    expected = {model.hub_name(n): shape for n, shape in model.tensors}
    converted = set(model.converted)
    if converted and not converted & set(held):
        # Saved by save_pretrained: the converted tensors in the hub's form, kept as they are.
        expected = {n: s for n, s in expected.items() if n not in converted}
        expected.update(model.hub_converted)
    tied = {model.hub_name(alias) for alias, _ in model.tied}
    problems: list[str] = []
    packed = _mxfp4_tensors(expected, held, storage, problems) if dequantized else {}
    for name, shape in expected.items():
        if name not in held:
            if name not in tied:
                problems.append(f"tensor {name} missing")
            continue
        path, entry = held[name]
        if entry.shape != shape:
            problems.append(
                f"{storage.describe(path)}: tensor {name} has shape {list(entry.shape)}, "
                f"{model.architecture} has {list(shape)}"
            )
    parts = {part for pair in packed.values() for _, part in pair}
    strays = sorted(set(held) - set(expected) - parts)
    if strays:
        problems.append(
            f"the checkpoint holds {', '.join(strays[:3])}"
            + (f" and {len(strays) - 3} more" if len(strays) > 3 else "")
            + f", which {model.architecture} has no place for"
        )
    if problems:
        raise CheckpointError(
            f"{where}: " + "; ".join(problems[:5]), hint=text_only_hint(config) or ""
        )
    kept_of = {model.hub_name(alias): model.hub_name(kept) for alias, kept in model.tied}
    replicas = tuple(
        Replica(held[kept][0], (kept,), held[kept][1].shape, held[alias][0], (alias,))
        for alias, kept in kept_of.items()
        if alias in held and kept in held
    )
    files = []
    for path, tensors in headers.items():
        stored = tuple(
            StoredTensor((name,), name, entry.shape, entry.dtype, (whole(entry.shape),))
            for name, entry in tensors.items()
            if name not in tied and name not in parts
        )
        stored += tuple(
            StoredTensor((name,), name, expected[name], mxfp4.DEQUANTIZED, (whole(expected[name]),))
            for at, name in packed
            if at == path
        )
        files.append(StoredFile(path, stored))
    generation = storage.read_text(GENERATION_CONFIG) if storage.exists(GENERATION_CONFIG) else None
    view = CheckpointView(
        Format.HF,
        None,
        ParallelLayout(),
        tuple(files),
        None,
        False,
        (
            f"HF {model.architecture} (checked by transformers; no family table: tensors by name)",
            why,
            *(
                [f"{len(packed)} expert weights stored in MXFP4, read as {mxfp4.DEQUANTIZED}"]
                if packed
                else []
            ),
        ),
        replicas=replicas,
        hf_named=HfNamedSource(model, json.dumps(config, indent=2), generation),
    )
    return view, headers, packed


def _mxfp4_tensors(
    expected: dict[str, tuple[int, ...]],
    held: dict[str, tuple[str, SafetensorsEntry]],
    storage: Storage,
    problems: list[str],
) -> Packed:
    """The model's tensors stored as MXFP4 blocks and scales in place of themselves; each one
    entered in ``held`` as the in-memory tensor (in its blocks' file)."""
    packed: Packed = {}
    for name, shape in expected.items():
        blocks, scales = name + mxfp4.BLOCKS, name + mxfp4.SCALES
        if name in held or blocks not in held:
            continue
        scales_entry = held[scales][1] if scales in held else None
        problem = mxfp4.parts_problem(name, shape, held[blocks][1], scales_entry)
        if problem is not None:
            where = "" if scales_entry is None else f"{storage.describe(held[blocks][0])}: "
            problems.append(where + problem)
        else:
            path = held[blocks][0]
            packed[(path, name)] = ((path, blocks), (held[scales][0], scales))
            held[name] = (path, SafetensorsEntry(mxfp4.DEQUANTIZED, shape, 0, 0))
    return packed
