"""DCP checkpoints of HF Llama models (FSDP2 / DTensor training of ``LlamaForCausalLM``). Pure.

Their keys are HF parameter names under whatever prefix the saver's state dict had
(``model.model.layers.0.self_attn.q_proj.weight`` for ``{"model": model_state_dict}``), and the
optimizer's state sits at ``<prefix><hf name>.<state>`` (``optim.state.model.layers.0...
.exp_avg``). Each stored chunk is a box of one HF tensor, which the HF mapping places in the
canonical tensors (q/k/v into the fused QKV, gate/up into ``linear_fc1``). The model's sizes come
from its ``config.json``: head counts cannot be read off the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.model.catalog import state_name
from ckptctl.model.geometry import Piece, Shape, chunk_pieces
from ckptctl.model.hf_layout import packed_expert, per_name_tensors
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


def prefixes(keys: list[str]) -> tuple[str, str | None] | None:
    """``(model prefix, optimizer prefix)`` if ``keys`` are an HF Llama state dict's."""
    model = next((k[: -len(ANCHOR)] for k in keys if k.endswith(ANCHOR)), None)
    if model is None:
        return None
    optim = next(
        (k[: -len(ANCHOR + ".exp_avg")] for k in keys if k.endswith(ANCHOR + ".exp_avg")), None
    )
    return model, optim


def key_table(spec: ModelSpec, model_prefix: str, optim_prefix: str | None) -> dict[str, HfKey]:
    """Every key such a checkpoint may hold, mapped onto canonical tensors."""
    table: dict[str, HfKey] = {}
    for name, canonical, shape, pieces in per_name_tensors(spec, "DCP"):
        table[model_prefix + name] = HfKey(canonical, shape, pieces)
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
