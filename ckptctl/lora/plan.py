"""A consolidation plan made a merge: every weight the adapter changes checked present in the
HF output with the shape the adapter implies, and the adapter named in the plan (so an output
of another adapter, or of none, is never taken for this one's)."""

from __future__ import annotations

from ckptctl.errors import LayoutError
from ckptctl.lora.adapter import LoraSource
from ckptctl.model.plan import Plan


def with_adapter(plan: Plan, adapter: LoraSource) -> Plan:
    written = {str(t.key[0]): t for f in plan.files for t in f.tensors if len(t.key) == 1}
    missing = sorted((set(adapter.pairs) | set(adapter.whole) | set(adapter.tokens)) - set(written))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise LayoutError(
            f"{adapter.url}: the base has no weight {', '.join(missing[:3])}{more}; "
            "the adapter was trained on another model"
        )
    for name, pair in adapter.pairs.items():
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
