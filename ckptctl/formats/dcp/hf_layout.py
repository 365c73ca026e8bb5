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
from ckptctl.model.geometry import Piece, Shape
from ckptctl.model.hf_layout import hf_tensors
from ckptctl.model.layout import ModelSpec

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
    for name, canonical, shape, pieces in hf_tensors(spec):
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
