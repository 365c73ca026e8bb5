"""``ckptctl inspect``: format, iteration, model, layout, files and sizes of a checkpoint."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ckptctl.cli.options import Iteration, Json, TrueVocab, state
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.units import human_bytes
from ckptctl.errors import LayoutError
from ckptctl.model.catalog import expert_of, is_state
from ckptctl.model.geometry import nbytes
from ckptctl.model.hf_families import choose_family
from ckptctl.model.layout import ModelSpec
from ckptctl.model.peft_wrapped import EmbeddedLora
from ckptctl.model.stored import CheckpointView
from ckptctl.pipeline.probe import Checkpoint, open_checkpoint


def inspect_cmd(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="Checkpoint directory or URL.")],
    as_json: Json = False,
    iteration: Iteration = None,
    true_vocab_size: TrueVocab = None,
) -> None:
    """Show format, iteration, model, layout, files and sizes of a checkpoint."""
    out = Output(as_json)
    cli = state(ctx)
    with boundary(out, cli.debug):
        ckpt = open_checkpoint(
            src,
            cli.settings,
            iteration=iteration,
            true_vocab_size=true_vocab_size,
            with_adapter=True,
        )
        info = describe(ckpt)
        out.json(info) if as_json else _show_inspect(out, info)


def describe(ckpt: Checkpoint) -> dict[str, Any]:
    view = ckpt.view
    files = []
    weights = optimizer = 0
    count = 0
    for f in view.files:
        file_total = 0
        for t in f.tensors:
            size = nbytes(t.shape, t.dtype)
            file_total += size
            count += 1
            if is_state(t.canonical):
                optimizer += size
            else:
                weights += size
        experts = sorted({e for t in f.tensors if (e := expert_of(t.canonical)) is not None})
        files.append(
            {
                "path": f.path,
                "rank": f.rank,
                "ep_rank": f.ep_rank,
                "experts": experts,
                "tensors": len(f.tensors),
                "tensor_bytes": file_total,
                "file_bytes": ckpt.storage.size(f.path),
            }
        )
    return {
        "url": ckpt.storage.url,
        "format": str(view.format),
        "iteration": view.iteration,
        "spec": view.spec.model_dump(mode="json") if view.spec else None,
        "hf": _hf_target(view.spec) if view.spec else _hf_named(view),
        "layout": view.layout.model_dump(mode="json"),
        "tensors": count,
        "weight_bytes": weights,
        "optimizer_bytes": optimizer,
        "has_optimizer": view.has_optimizer,
        "files": files,
        "notes": list(view.notes),
        "warnings": list(view.warnings),
        "adapter": _adapter(ckpt.adapter),
    }


def _adapter(adapter: EmbeddedLora | None) -> dict[str, Any] | None:
    """A LoRA adapter trained inside the checkpoint: its modules and ranks."""
    if adapter is None:
        return None
    ranks: dict[str, int] = {}
    count = size = 0
    for f in adapter.files:
        for t in f.tensors:
            count += 1
            size += nbytes(t.shape, t.dtype)
            if t.canonical.endswith(("lora_A.weight", "lora_embedding_A", "linear_in.weight")):
                dim = 1 if adapter.megatron else 0  # Megatron-Bridge's: [layer, rank, in]
                rows = max((p.canonical[dim] + p.sizes[dim] for p in t.pieces), default=0)
                ranks[t.canonical] = max(ranks.get(t.canonical, 0), rows)
    return {
        "name": adapter.name,
        "modules": len(adapter.modules),
        "ranks": sorted(set(ranks.values())),
        "tensor_bytes": size,
        "tensors": count,
        "alone": adapter.alone,
        "lora_alpha": adapter.trained.alpha if adapter.trained is not None else None,
    }


def _hf_named(view: CheckpointView) -> dict[str, Any] | None:
    """An HF model known by name only: its class, and that it has no family table."""
    if view.hf_named is None:
        return None
    return {"architecture": view.hf_named.model.architecture, "refused": [], "by_name": True}


def _hf_target(spec: ModelSpec) -> dict[str, Any]:
    """The transformers class ``consolidate --format hf`` would write, or why none can."""
    try:
        family = choose_family(spec)
    except LayoutError as err:
        return {"architecture": None, "refused": err.problems}
    return {"architecture": family.architecture, "refused": []}


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][-1] == v - 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "-"


def _show_inspect(out: Output, info: dict[str, Any]) -> None:
    spec, layout = info["spec"], info["layout"]
    out.show(f"[bold]{info['url']}[/]  {info['format']}  iteration {info['iteration']}")
    if spec is None and info["hf"] is not None:
        out.show(
            f"model: HF {info['hf']['architecture']} by name (shapes checked by transformers; "
            "no family table: HF and torch targets only)"
        )
    elif info["adapter"] is not None and info["adapter"]["alone"]:
        out.show("model: none saved (the LoRA adapter alone)")
    elif spec is None:
        out.show("model: unknown family (keys are not Megatron-Core's or HF Llama's)")
    else:
        model = ModelSpec.model_validate(spec)
        out.show(f"model: {model.describe()}")
        hf = info["hf"]
        out.show(
            f"HF: {hf['architecture']}"
            if hf["architecture"]
            else f"HF: none ({'; '.join(hf['refused'])})"
        )
    if info["adapter"] is not None:
        lora = info["adapter"]
        alpha = lora["lora_alpha"]
        flag = "" if alpha else " --lora-alpha A"
        merge = f"merge-lora BASE SRC DST{flag}" if lora["alone"] else f"merge-lora SRC DST{flag}"
        out.show(
            f"LoRA adapter {lora['name']!r} trained in: {lora['modules']} modules, rank "
            f"{'/'.join(map(str, lora['ranks']))}"
            + (f", alpha {alpha:g}" if alpha else "")
            + f" ({merge} merges it; --adapter-only exports it)"
        )
    out.show("layout: " + " ".join(f"{k}={v}" for k, v in layout.items() if v not in (None, False)))
    moe = spec is not None and spec.get("num_experts")
    if moe:
        per_rank = spec["num_experts"] // layout["ep"]
        out.show(
            f"experts: {per_rank} of {spec['num_experts']} per EP rank (EP{layout['ep']}), "
            f"expert TP {layout['etp'] or layout['tp']}"
        )
    rank_title = "rank (tp, pp, ep)" if moe else "rank (tp, pp)"
    columns = [rank_title, "tensors", "bytes"] + (["experts"] if moe else [])
    table = out.table("file", *columns)
    for f in info["files"]:
        rank = (*f["rank"], f["ep_rank"]) if moe and f["rank"] else f["rank"]
        row = [
            f["path"],
            str(tuple(rank)) if rank else "-",
            str(f["tensors"]),
            human_bytes(f["file_bytes"]),
        ]
        if moe:
            row.append(_ranges(f["experts"]))
        table.add_row(*row)
    out.show(table)
    out.show(
        f"{info['tensors']} tensors: weights {human_bytes(info['weight_bytes'])}, optimizer state "
        f"{human_bytes(info['optimizer_bytes'])}"
    )
    for note in info["notes"]:
        out.note(note)
    for warning in info["warnings"]:
        out.warn(warning)
