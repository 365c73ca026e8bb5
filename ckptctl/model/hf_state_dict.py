"""HF-named torch state dicts (FSDP2's DCP saves, verl's and accelerate's rank files) as boxes of
the canonical tensors. Pure.

Their keys are HF parameter names under whatever prefix the saver's state dict had
(``model.model.layers.0.self_attn.q_proj.weight`` for ``{"model": model_state_dict}``), and the
optimizer's state sits at ``<prefix><hf name>.<state>`` (``optim.state.model.layers.0...
.exp_avg``). Each stored chunk is a box of one HF tensor, which the HF mapping places in the
canonical tensors (q/k/v into the fused QKV, gate/up into ``linear_fc1``). The model's sizes come
from its ``config.json``: head counts cannot be read off the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ckptctl.model import hf_gpt_oss, hf_qwen35
from ckptctl.model.catalog import state_name
from ckptctl.model.geometry import Piece, Shape, chunk_pieces
from ckptctl.model.hf_families import choose_family
from ckptctl.model.hf_layout import Entry, hf_tensors, packed_expert, per_name_tensors
from ckptctl.model.layout import ModelSpec
from ckptctl.model.stored import KeyPath, StoredTensor

ANCHOR = "model.embed_tokens.weight"
"""An HF Llama parameter every checkpoint has: where it sits reveals the key prefixes."""
STATES = ("exp_avg", "exp_avg_sq", "step")


@dataclass(frozen=True, slots=True)
class HfKey:
    canonical: str
    shape: Shape
    """The HF tensor's shape (``()`` for Adam's step)."""
    pieces: tuple[Piece, ...]
    """Pieces of the whole HF tensor (its coordinates -> canonical coordinates)."""
    shift: float = 0.0
    """Stored as the canonical values plus this (Qwen3.5's gated norm weight: one plus
    Megatron's zero-centred one); never on Adam's state, whose moments are the same."""


def prefixes(keys: list[str]) -> tuple[str, str | None] | None:
    """``(model prefix, optimizer prefix)`` if ``keys`` are an HF Llama state dict's."""
    model = next((k[: -len(ANCHOR)] for k in keys if k.endswith(ANCHOR)), None)
    if model is None:
        return None
    optim = next(
        (k[: -len(ANCHOR + ".exp_avg")] for k in keys if k.endswith(ANCHOR + ".exp_avg")), None
    )
    return model, optim


def dcp_entries(spec: ModelSpec) -> list[Entry]:
    """The HF tensors of ``spec`` taken one name at a time (Qwen3.5's shifted gated norms
    among them: ``HfKey.shift``); GPT-OSS's packed experts are left to ``block_table``."""
    if choose_family(spec).name == hf_gpt_oss.MODEL_TYPE:
        return [e for e in hf_tensors(spec) if hf_gpt_oss.block(spec, *e[:3]) is None]
    entries = hf_tensors(spec)
    if any(hf_qwen35.value_shift(spec, name) for name, *_ in entries):
        return entries
    return per_name_tensors(spec, "DCP")


def key_table(spec: ModelSpec, model_prefix: str, optim_prefix: str | None) -> dict[str, HfKey]:
    """Every key such a checkpoint may hold, mapped onto canonical tensors (GPT-OSS's packed
    experts: ``block_table``)."""
    table: dict[str, HfKey] = {}
    for name, canonical, shape, pieces in dcp_entries(spec):
        shift = hf_qwen35.value_shift(spec, name)
        table[model_prefix + name] = HfKey(canonical, shape, pieces, shift)
        if optim_prefix is None:
            continue
        for state in STATES:
            if state == "step":  # Adam's count, one 0-d tensor per parameter
                table[f"{optim_prefix}{name}.step"] = HfKey(
                    state_name("step", canonical), (), (Piece((), (), ()),)
                )
            else:
                table[f"{optim_prefix}{name}.{state}"] = HfKey(
                    state_name(state, canonical), shape, pieces
                )
    return table


@dataclass(frozen=True, slots=True)
class PackedKey:
    """A tensor of every expert of a layer as transformers 5 holds it in memory
    (``experts.gate_up_proj`` ``[E, 2F, H]``, ``experts.down_proj`` ``[E, H, F]``): the hub
    tensors it packs, each ``(expert, first row, rows, key)`` in an expert's matrix."""

    shape: Shape
    parts: tuple[tuple[int, int, int, HfKey], ...]


def packed_table(
    table: dict[str, HfKey], spec: ModelSpec, prefixes: tuple[str, ...]
) -> dict[str, PackedKey]:
    """The packed keys standing for the per-expert keys of ``table`` (under each of the
    ``prefixes``: the model's, and the optimizer's with a state suffix)."""
    parts: dict[str, list[tuple[int, int, int, HfKey]]] = {}
    shapes: dict[str, Shape] = {}
    for key, entry in table.items():
        for prefix in prefixes:
            if not key.startswith(prefix):
                continue
            name, _, state = key[len(prefix) :].partition(".weight")
            packed = packed_expert(spec, name + ".weight")
            if packed is None:
                continue
            whole_name, shape, offset = packed
            expert_elements = shape[1] * shape[2]
            expert, first = divmod(offset, expert_elements)
            packed_key = prefix + whole_name + state
            is_step = state.endswith("step")
            parts.setdefault(packed_key, []).append(
                (expert, first // shape[2], entry.shape[0] if not is_step else 0, entry)
            )
            shapes[packed_key] = () if is_step else shape
    return {
        k: PackedKey(shapes[k], tuple(sorted(v, key=lambda p: p[:2]))) for k, v in parts.items()
    }


def packed_chunk(
    fqn: str, packed: PackedKey, offsets: Shape, sizes: Shape, dtype: str
) -> list[StoredTensor]:
    """The per-expert tensors a stored box of a packed tensor holds: each a contiguous run of
    the box's elements (a view of it), placed in its expert's canonical tensor."""
    key: KeyPath = (fqn, *offsets)
    if not packed.shape:  # Adam's step of the packed parameter: one for each canonical tensor
        seen: dict[str, StoredTensor] = {}
        for _, _, _, entry in packed.parts:
            seen.setdefault(
                entry.canonical, StoredTensor(key, entry.canonical, (), dtype, entry.pieces)
            )
        return list(seen.values())
    e0, r0, c0 = offsets
    ne, nr, nc = sizes
    out = []
    for expert, first, rows, entry in packed.parts:
        if not e0 <= expert < e0 + ne:
            continue
        lo, hi = max(r0, first), min(r0 + nr, first + rows)
        if lo >= hi or nc == 0:
            continue
        pieces = chunk_pieces(entry.pieces, (lo - first, c0), (hi - lo, nc))
        start = (expert - e0) * nr * nc + (lo - r0) * nc
        out.append(StoredTensor(key, entry.canonical, (hi - lo, nc), dtype, pieces, start))
    return out


@dataclass(frozen=True, slots=True)
class BlockKey:
    """A GPT-OSS packed tensor (``experts.gate_up_proj`` ``[E, H, 2F]``, its bias
    ``[E, 2F]``, ``experts.down_proj`` ``[E, F, H]``, its bias ``[E, H]``: transformers holds them
    in memory as its hub checkpoints store them): each expert's block, which is one canonical
    tensor, stored transposed (the matrices) and with gate and up interleaved (``gate_up``)."""

    shape: Shape
    """The stored tensor's shape (``()`` for Adam's step)."""
    experts: tuple[tuple[str, Shape, tuple[Piece, ...]], ...]
    """Each expert's canonical tensor, its shape in Megatron's orientation and its pieces."""
    transposed: bool
    interleaved: bool


def block_table(
    spec: ModelSpec, model_prefix: str, optim_prefix: str | None
) -> dict[str, BlockKey]:
    """GPT-OSS's packed tensors (and their Adam state) such a checkpoint may hold; empty for
    the other families."""
    if choose_family(spec).name != hf_gpt_oss.MODEL_TYPE:
        return {}
    grouped: dict[str, list[tuple[str, Shape, tuple[Piece, ...]]]] = {}
    blocks: dict[str, hf_gpt_oss.Block] = {}
    for name, canonical, shape, pieces in hf_tensors(spec):
        block = hf_gpt_oss.block(spec, name, canonical, shape)
        if block is not None:  # hf_tensors lists each packed tensor's experts in order
            grouped.setdefault(name, []).append((canonical, shape, pieces))
            blocks[name] = block
    table: dict[str, BlockKey] = {}
    for name, experts in grouped.items():
        block = blocks[name]
        table[model_prefix + name] = BlockKey(
            block.base_shape, tuple(experts), block.transposed, block.interleaved
        )
        if optim_prefix is None:
            continue
        for state in STATES:
            if state == "step":  # one count for the packed parameter: each expert's
                count = (Piece((), (), ()),)
                steps = tuple((state_name("step", c), (), count) for c, *_ in experts)
                table[f"{optim_prefix}{name}.step"] = BlockKey((), steps, False, False)
            else:
                states = tuple((state_name(state, c), s, p) for c, s, p in experts)
                table[f"{optim_prefix}{name}.{state}"] = BlockKey(
                    block.base_shape, states, block.transposed, block.interleaved
                )
    return table


def block_chunk(
    fqn: str, key: BlockKey, offsets: Shape, sizes: Shape, dtype: str
) -> list[StoredTensor] | None:
    """The expert blocks a stored chunk of a packed tensor holds, each a run of the chunk's
    elements; ``None`` when the chunk cuts inside an expert's block (FSDP cuts dim 0, the
    experts, unless there are fewer experts than ranks)."""
    where: KeyPath = (fqn, *offsets)
    if not key.shape:
        return [StoredTensor(where, c, (), dtype, p) for c, _, p in key.experts]
    first, *inner_offsets = offsets
    count, *inner = sizes
    if any(inner_offsets) or tuple(inner) != key.shape[1:]:
        return None
    size = prod(inner)
    out = []
    for k in range(count):
        canonical, shape, pieces = key.experts[first + k]
        out.append(
            StoredTensor(
                where,
                canonical,
                shape,
                dtype,
                pieces,
                k * size,
                transposed=key.transposed,
                interleaved=key.interleaved,
            )
        )
    return out
