"""Checkpoints of named tensors read under a known model's naming. Pure.

A single ``torch.save`` state dict or a DCP checkpoint whose keys ckptctl does not place by
itself is a *generic* view: each stored key is its own tensor. When another checkpoint of the
same model is at hand (``verify --against``), its model description says what those keys are:
Megatron-Core's sharded keys (``torch_dist``: layer-stacked ``decoder.layers.<suffix>`` with a
leading layer dimension, ``optimizer.state.<state>.<key>``), Megatron's canonical names
(``decoder.layers.<n>.<suffix>``), or HF parameter names (with Adam state at ``<name>.<state>``).
Each is tried, under whatever prefix the saver nested the state dict in, and the one that places
the most tensors wins; keys none places keep their stored names.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from math import prod

from ckptctl.formats.megatron_common.sharded_keys import chunk_parts, model_catalog
from ckptctl.model.catalog import Param
from ckptctl.model.geometry import Shape, Split, chunk_pieces
from ckptctl.model.hf_state_dict import BlockKey, block_table, key_table, prefixes
from ckptctl.model.layout import ModelSpec
from ckptctl.model.stored import CheckpointView, StoredTensor, canonical_shapes

MEGATRON_ANCHOR = "embedding.word_embeddings.weight"
"""A Megatron parameter every first stage holds: where it sits reveals the key prefix."""


def _offsets(tensor: StoredTensor) -> tuple[int, ...]:
    """Where a generic tensor (one chunk of its key's global tensor) starts in that tensor."""
    if tensor.pieces:
        return tensor.pieces[0].canonical
    return (0,) * len(tensor.shape)


def _megatron_prefix(names: set[str]) -> str:
    """The shortest prefix under which a key names the embedding (``""`` for none)."""
    found = [n[: -len(MEGATRON_ANCHOR)] for n in names if n.endswith(MEGATRON_ANCHOR)]
    plain = [p for p in found if "optimizer.state." not in p]
    return min(plain, key=len) if plain else ""


def _whole_params(key: str, shape: Shape, catalog: dict[str, Param]) -> bool:
    """Whether the global tensor ``key`` of ``shape`` holds whole parameters of the model (one,
    or one per layer and expert for a stacked key): every part the same shape as its parameter
    (the vocabulary may be padded), so that no key is placed by clipping it to fit."""
    parts = chunk_parts(key, (0,) * len(shape), shape, catalog)
    if not parts:
        return False
    for part in parts:
        param = catalog[part.canonical.split("/")[-1]]
        if sum(p.numel for p in part.pieces) != prod(param.shape):
            return False
        padded = param.split is Split.VOCAB and part.shape[0] >= param.shape[0]
        if part.shape != param.shape and not (padded and part.shape[1:] == param.shape[1:]):
            return False
    return True


def _as_megatron(view: CheckpointView, spec: ModelSpec) -> tuple[CheckpointView, int]:
    catalog = model_catalog(spec)
    shapes = canonical_shapes(view)
    prefix = _megatron_prefix(set(shapes))
    placed = 0
    files = []
    for file in view.files:
        tensors: list[StoredTensor] = []
        for t in file.tensors:
            name = t.canonical
            parts = None
            if name.startswith(prefix) or _is_prefixed_state(name, prefix):
                key = _strip(name, prefix)
                if _whole_params(key, shapes[name][0], catalog):
                    parts = chunk_parts(key, _offsets(t), t.shape, catalog)
            if parts is None:
                tensors.append(t)
                continue
            placed += 1
            tensors.extend(
                StoredTensor(
                    t.key,
                    part.canonical,
                    part.shape,
                    t.dtype,
                    part.pieces,
                    view_offset=part.view_offset,
                )
                for part in parts
            )
        files.append(replace(file, tensors=tuple(tensors)))
    return replace(view, spec=spec, files=tuple(files)), placed


def _is_prefixed_state(name: str, prefix: str) -> bool:
    """``optimizer.state.<state>.<prefix><key>``: optimizer state of a prefixed key."""
    if not prefix or not name.startswith("optimizer.state."):
        return False
    return name.split(".", 3)[-1].startswith(prefix)


def _strip(name: str, prefix: str) -> str:
    if not prefix:
        return name
    if name.startswith(prefix):
        return name[len(prefix) :]
    head, _, rest = name.partition(".state.")
    state, _, key = rest.partition(".")
    return f"{head}.state.{state}.{key.removeprefix(prefix)}"


def _as_hf(
    view: CheckpointView, spec: ModelSpec, packed: bool = False
) -> tuple[CheckpointView, int]:
    shapes = canonical_shapes(view)
    found = prefixes(list(shapes))
    if found is None:
        return view, 0
    table = key_table(spec, *found)
    blocks = block_table(spec, *found) if packed else {}
    placed = 0
    files = []
    for file in view.files:
        tensors: list[StoredTensor] = []
        for t in file.tensors:
            block = blocks.get(t.canonical)
            if block is not None and shapes[t.canonical][0] == block.shape:
                views = _block_views(t, block)
                if views is not None:
                    placed += 1
                    tensors.extend(views)
                    continue
            entry = table.get(t.canonical)
            # a weight stored shifted (Qwen3.5's gated norm) is read right only by a reader
            # that takes the shift off (``packed``): left by its name otherwise
            shifted = entry is not None and entry.shift and not packed
            if entry is None or shifted or shapes[t.canonical][0] != entry.shape:
                tensors.append(t)
                continue
            placed += 1
            pieces = chunk_pieces(entry.pieces, _offsets(t), t.shape)
            tensors.append(
                StoredTensor(t.key, entry.canonical, t.shape, t.dtype, pieces, shift=entry.shift)
            )
        files.append(replace(file, tensors=tuple(tensors)))
    return replace(view, spec=spec, files=tuple(files)), placed


def _block_views(t: StoredTensor, block: BlockKey) -> list[StoredTensor] | None:
    """The expert blocks a generic tensor of a GPT-OSS packed tensor holds (whole experts),
    each a view of it to be read turned and with gate and up apart; ``None`` when it cuts
    inside an expert's block."""
    offsets = _offsets(t)
    if not t.shape:  # Adam's step of the packed parameter: one for each expert
        return [replace(t, canonical=c, pieces=p) for c, _, p in block.experts]
    if any(offsets[1:]) or t.shape[1:] != block.shape[1:]:
        return None
    size, start = prod(t.shape[1:]), t.view_offset or 0
    return [
        StoredTensor(
            t.key,
            canonical,
            shape,
            t.dtype,
            pieces,
            start + k * size,
            transposed=block.transposed,
            interleaved=block.interleaved,
        )
        for k, (canonical, shape, pieces) in enumerate(
            block.experts[offsets[0] : offsets[0] + t.shape[0]]
        )
    ]


def under_spec(
    view: CheckpointView, spec: ModelSpec, packed: bool = False
) -> tuple[CheckpointView, int]:
    """``view`` (generic: each key its own tensor) with its keys placed in ``spec``'s canonical
    tensors by the naming that places the most of them, and how many it placed (0: none
    did, and the view is returned as it was). ``packed``: the reader takes GPT-OSS's expert
    blocks (``StoredTensor.interleaved``, transposed) and shifted weights, so HF names place
    them too."""
    best, placed = view, 0
    for naming in (_as_megatron, partial(_as_hf, packed=packed)):
        candidate, count = naming(view, spec)
        if count > placed:
            best, placed = candidate, count
    return best, placed
