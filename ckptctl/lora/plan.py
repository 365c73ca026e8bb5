"""A consolidation plan made a merge: every weight the adapter changes checked present in the
HF output with the shape the adapter implies, and the adapter named in the plan (so an output
of another adapter, or of none, is never taken for this one's)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ckptctl.errors import LayoutError
from ckptctl.lora.adapter import LoraSource
from ckptctl.model.hf_layout import packed_expert
from ckptctl.model.plan import Plan


@dataclass(frozen=True, slots=True)
class ExpertRoute:
    """Where an expert's own HF tensor (``experts.3.up_proj.weight``: the hub's layout, which
    the output keeps) lies in the packed parameter its adapter was trained on
    (``experts.gate_up_proj [E, 2F, H]``, transformers 5's in memory)."""

    packed: str
    expert: int
    row: int
    """Its first row in the expert's ``[out, in]`` block (gate rows, then up rows)."""


def expert_routes(plan: Plan, adapter: LoraSource) -> dict[str, ExpertRoute]:
    """The output's per-expert tensors that an adapter on packed experts changes, by name."""
    packed = {name for name, pair in adapter.pairs.items() if pair.experts}
    if not packed or plan.spec is None:
        return {}
    out = {}
    for file in plan.files:
        for tensor in file.tensors:
            name = str(tensor.key[0])
            found = packed_expert(plan.spec, _in_memory(name)) if len(tensor.key) == 1 else None
            if found is not None and found[0] in packed:
                packed_name, (_, rows, columns), offset = found
                expert, within = divmod(offset, rows * columns)
                out[name] = ExpertRoute(packed_name, expert, within // columns)
    return out


_MIXTRAL = re.compile(r"(.*\.)block_sparse_moe\.experts\.(\d+)\.(w1|w3|w2)\.weight")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _in_memory(name: str) -> str:
    """A Mixtral hub expert tensor (``block_sparse_moe.experts.N.w1``) by the names transformers
    5 gives it (``mlp.experts.N.gate_proj``, then packed: what PEFT's adapter names)."""
    match = _MIXTRAL.fullmatch(name)
    if match is None:
        return name
    prefix, expert, part = match.groups()
    return f"{prefix}mlp.experts.{expert}.{_MIXTRAL_PARTS[part]}.weight"


def under_written_names(adapter: LoraSource, hub_names: dict[str, str]) -> None:
    """Name what ``adapter`` changes as the HF output writes it: PEFT names a module as
    transformers holds it in memory (a VLM's ``model.language_model.*``), ``save_pretrained``
    writes some of those tensors under other names (the hub's ``model.*``; ``hub_names``:
    in-memory -> written), which is what the base's plan writes."""
    if not hub_names:
        return

    def named(name: str) -> str:
        return hub_names.get(name, name)

    adapter.pairs = {named(k): replace(v, weight=named(v.weight)) for k, v in adapter.pairs.items()}
    adapter.whole = {named(k): replace(v, weight=named(v.weight)) for k, v in adapter.whole.items()}
    adapter.tokens = {
        named(k): replace(v, weight=named(v.weight)) for k, v in adapter.tokens.items()
    }


def with_adapter(plan: Plan, adapter: LoraSource) -> Plan:
    written = {str(t.key[0]): t for f in plan.files for t in f.tensors if len(t.key) == 1}
    routed = {route.packed for route in expert_routes(plan, adapter).values()}
    held = set(written) | routed
    missing = sorted((set(adapter.pairs) | set(adapter.whole) | set(adapter.tokens)) - held)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise LayoutError(
            f"{adapter.url}: the base has no weight {', '.join(missing[:3])}{more}; "
            "the adapter was trained on another model"
        )
    for name, pair in adapter.pairs.items():
        if name in routed and name not in written:  # the hub's per-expert tensors
            assert plan.spec is not None
            spec = plan.spec
            experts, ffn, h = spec.num_experts or 0, spec.expert_ffn_size, spec.hidden_size
            block = (2 * ffn, h) if name.endswith("gate_up_proj") else (h, ffn)
            if (experts, *block) != (pair.experts, *pair.shape):
                raise LayoutError(
                    f"{adapter.url}: {name} is {[experts, *block]} in the base, but its "
                    f"adapter spans {pair.experts} experts of {list(pair.shape)}; the adapter "
                    "was trained on another model"
                )
            continue
        shape = tuple(written[name].shape)
        packed = written[name].base_shape
        if pair.experts and not (
            written[name].transposed and packed is not None and len(packed) == 3
        ):
            raise LayoutError(
                f"{adapter.url}: {name} adapts {pair.experts} packed experts, but the base "
                "does not store that weight packed as [experts, in, out] (GPT-OSS's layout)"
            )
        if pair.experts and packed is not None and packed[0] != pair.experts:
            raise LayoutError(
                f"{adapter.url}: {name}'s adapter spans {pair.experts} experts, the base has "
                f"{packed[0]}; the adapter was trained on another model"
            )
        if shape != pair.shape:
            raise LayoutError(
                f"{adapter.url}: {name} is {list(shape)} in the base, but its adapter's "
                f"B @ A is {list(pair.shape)}; the adapter was trained on another model"
            )
    for name, replaced in adapter.whole.items():
        shape = tuple(written[name].shape)
        if shape != replaced.shape:
            raise LayoutError(
                f"{adapter.url}: {name} is {list(shape)} in the base, but the adapter's trained "
                f"copy (modules_to_save) is {list(replaced.shape)}; resize the base's "
                "vocabulary first, as the training did"
            )
    for name, rows in adapter.tokens.items():
        shape = tuple(written[name].shape)
        if max(rows.indices) >= shape[0]:
            raise LayoutError(
                f"{adapter.url}: trainable_token_indices reach row {max(rows.indices)}, but "
                f"{name} has {shape[0]} rows in the base; resize its vocabulary first"
            )
    ranks = sorted({p.rank for p in adapter.pairs.values()})
    scalings = sorted({p.scaling for p in adapter.pairs.values()})
    terms = (
        f": rank {'/'.join(map(str, ranks))}, scaling {'/'.join(f'{s:g}' for s in scalings)}, "
        "in float32, rounded once to each weight's dtype"
        if adapter.pairs
        else ""
    )
    note = (
        f"LoRA adapter {adapter.url} (xxh3 {adapter.fingerprint}) merged into "
        f"{len(adapter.pairs)} weights{terms}"
        + (
            f"; {len(adapter.whole)} tensors of modules_to_save taken whole from it"
            if adapter.whole
            else ""
        )
        + "".join(
            f"; {len(r.indices)} trained rows of {name}" for name, r in adapter.tokens.items()
        )
    )
    return plan.model_copy(update={"operation": "merge-lora", "notes": (*plan.notes, note)})
