"""Writing Megatron legacy rank files: the pickled tree of each ``model_optim_rng.pt`` (model,
optimizer with its parameter groups, carried training state, ``args``) with tensors streamed
in, and ``distrib_optim.pt`` as flat buffers in offset order."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from math import prod
from typing import Any

from ckptctl.formats.base import WriteJob
from ckptctl.formats.megatron_common.layout import group_kinds
from ckptctl.formats.megatron_common.training_state import group_template, training_state
from ckptctl.formats.torchsave.zip_writer import TensorSlot, write_torch_zip
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.prefetch import ReadAhead
from ckptctl.io.runs import Run
from ckptctl.model.catalog import parameters
from ckptctl.model.dtypes import DTYPES
from ckptctl.model.plan import FileWrite, TensorWrite


def _without_step(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "step"}


def distributed_optimizer_entry(
    kinds: list[bool],
    group_templates: dict[bool, dict[str, Any]],
    step: float | None,
    carried: dict[str, Any],
    experts: bool = False,
) -> dict[str, Any]:
    """``model_optim_rng.pt['optimizer']`` under the distributed optimizer: group settings only
    (weight-decay group first, as Megatron-Core 0.16), Adam's step kept per group."""
    groups = []
    for kind in sorted(set(kinds)):
        group = group_template(group_templates, kind, experts) if kind in group_templates else {}
        if "step" not in group and step is not None:
            group["step"] = step
        groups.append(group)
    return {"optimizer": {"param_groups": groups}, **carried.get("optimizer_extra", {})}


def rank_tree(
    file: FileWrite,
    *,
    args: argparse.Namespace,
    carried: dict[str, Any],
    group_templates: dict[bool, dict[str, Any]],
    no_weight_decay: dict[str, bool],
    optimizer_entry: Any = None,
    expert_kinds: frozenset[bool] = frozenset(),
) -> tuple[dict[str | int, Any], list[TensorSlot]]:
    """The object tree of one rank file; its stored tensors are slots, in ``file.tensors``
    order (a tensor that several blocks share, as ``GroupedMLP``'s, is one slot).

    ``carried`` is ``carried_state`` of a source file; ``no_weight_decay`` maps canonical
    parameter names to their parameter-group kind; ``expert_kinds``: the groups of an expert
    optimizer on a stage without experts (chained, empty, as megatron-core 0.16 keeps it).
    """
    tree: dict[str | int, Any] = {
        "args": args,
        "checkpoint_version": carried["checkpoint_version"],
        "iteration": carried["iteration"],
    }
    slots = []
    index_kind: dict[tuple[int, ...], dict[int, bool]] = {}
    seen: set[tuple[str | int, ...]] = set()
    for n, t in enumerate(file.tensors):
        if t.key not in seen:
            seen.add(t.key)
            shape = t.base_shape or (t.shape[::-1] if t.transposed else t.shape)
            slot = TensorSlot(str(n), t.dtype, shape)
            slots.append(slot)
            node = tree
            for part in t.key[:-1]:
                node = node.setdefault(part, {})
            node[t.key[-1]] = slot
        if "state" in t.key and t.key[0] == "optimizer":
            at = t.key.index("state")
            sub = tuple(k for k in t.key[1:at] if isinstance(k, int))
            index_kind.setdefault(sub, {})[int(t.key[at + 1])] = no_weight_decay[
                t.canonical.split("/", 1)[1]
            ]
    if "optimizer" in tree:
        if all(isinstance(k, int) for k in tree["optimizer"]):  # chained: dense, then experts
            subs = tree["optimizer"]
            tree["optimizer"] = [
                _optimizer_dict(subs[i], index_kind.get((i,), {}), group_templates, carried, i > 0)
                for i in sorted(subs)
            ]
            if len(subs) == 1 and expert_kinds:
                first = tree["optimizer"][0]
                tree["optimizer"].append(
                    _empty_optimizer(first, expert_kinds, group_templates, carried)
                )
        else:
            _optimizer_dict(tree["optimizer"], index_kind.get((), {}), group_templates, carried)
    if optimizer_entry is not None:
        tree["optimizer"] = optimizer_entry
    for key, value in carried.items():
        if key not in tree and key != "optimizer_extra":
            tree[key] = value
    return tree, slots


def _optimizer_dict(
    opt: dict[str, Any],
    index_kind: dict[int, bool],
    group_templates: dict[bool, dict[str, Any]],
    carried: dict[str, Any],
    experts: bool = False,
) -> dict[str, Any]:
    """One (sub-)optimizer's state dict completed in place: state in index order, parameter
    groups from the templates, fp32 masters as per-group lists, carried extras."""
    torch_state = opt if "state" in opt else opt["optimizer"]  # bare or wrapped
    # torch packs state in parameter-index order (group after group), not model order.
    torch_state["state"] = dict(sorted(torch_state["state"].items()))
    members: dict[bool, list[int]] = {}
    for index in sorted(index_kind):
        members.setdefault(index_kind[index], []).append(index)
    # Adam's step lives per parameter here, so a group-level step (distributed) is dropped.
    torch_state["param_groups"] = [
        {**_without_step(group_template(group_templates, kind, experts)), "params": indices}
        for kind, indices in members.items()
    ]
    if "fp32_from_fp16_params" in opt:
        masters = opt["fp32_from_fp16_params"]
        opt["fp32_from_fp16_params"] = [
            [masters[g][i] for i in sorted(masters[g])] for g in sorted(masters)
        ]
    opt.update(carried.get("optimizer_extra", {}))
    return opt


def _empty_optimizer(
    like: dict[str, Any],
    kinds: frozenset[bool],
    group_templates: dict[bool, dict[str, Any]],
    carried: dict[str, Any],
) -> dict[str, Any]:
    """The expert optimizer of a stage without experts: its groups, empty, in ``like``'s form
    (the dense optimizer's: bare, or wrapped with its fp32 masters)."""
    groups = [
        {**_without_step(group_template(group_templates, kind, True)), "params": []}
        for kind in sorted(kinds)
        if kind in group_templates
    ]
    torch_state = {"state": {}, "param_groups": groups}
    if "state" in like:  # bare
        return {**torch_state, **carried.get("optimizer_extra", {})}
    opt: dict[str, Any] = {"optimizer": torch_state}
    if "fp32_from_fp16_params" in like:
        opt["fp32_from_fp16_params"] = [[] for _ in groups]
    opt.update(carried.get("optimizer_extra", {}))
    return opt


def write_distopt_file(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    """``distrib_optim.pt``: each flat buffer streamed in offset order, gaps as zeros."""
    assemble = job.assemble
    chained = bool(file.flat) and len(file.flat[0][0]) == 4
    # A chained optimizer's file is a list (dense, expert); the dense state may be absent.
    subs: dict[int, dict[Any, Any]] = {}
    slots: list[TensorSlot] = []
    members: dict[TensorSlot, list[TensorWrite]] = {}
    for key, length in file.flat:
        sub, (gbuf, dtype_key, state) = (key[0], key[1:]) if chained else (0, key)
        tree = subs.setdefault(int(sub), {"buckets_coalesced": True})
        param_dtype, grad_dtype = (DTYPES[name] for name in str(dtype_key).split("|"))
        buffer = tree.setdefault(gbuf, {}).setdefault((param_dtype, grad_dtype), {})
        slot = TensorSlot(str(len(slots)), "float32", (length,))
        buffer.pop("numel_unpadded", None)  # Megatron writes it after the state tensors
        buffer[state] = slot
        buffer["numel_unpadded"] = length
        slots.append(slot)
        members[slot] = sorted(
            (t for t in file.tensors if t.key == key), key=lambda t: t.view_offset or 0
        )

    def produce(slot: TensorSlot) -> Iterator[memoryview | Run]:
        pos = 0
        for write in members[slot]:
            assert write.view_offset is not None and write.view_offset >= pos
            yield from _zeros(write.view_offset - pos)
            yield from assemble.chunks(write, file.path)
            pos = write.view_offset + prod(write.shape)
        yield from _zeros(slot.shape[0] - pos)

    root: Any = [subs.get(i) for i in range(2)] if chained else subs.get(0, {})
    assemble.expect(w for slot in slots for w in members[slot])
    with ReadAhead(slots, produce) as ahead:
        write_torch_zip(out, root, slots, ahead)


def _zeros(count: int, chunk: int = 1 << 20) -> Iterator[memoryview]:
    """``count`` fp32 zeros (alignment gaps of a flat buffer), in bounded chunks."""
    block = memoryview(bytes(4 * min(count, chunk)))
    while count > 0:
        n = min(count, chunk)
        yield block[: 4 * n]
        count -= n


def write_rank_file(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    """One ``model_optim_rng.pt``: its pickled tree first, then every tensor streamed."""
    plan, assemble = job.plan, job.assemble
    state = training_state(job, file)
    catalog = {p.name: p for p in parameters(plan.model())}
    no_wd = {name: p.no_weight_decay for name, p in catalog.items()}
    entry: Any = None
    if plan.target_layout.distributed_optimizer and state.optimizer_step is not None:
        trained = [catalog[t.canonical] for t in file.tensors if not catalog[t.canonical].buffer]
        step, carried = state.optimizer_step, state.carried
        if plan.target_layout.ep > 1:  # chained: the dense optimizer's groups, the experts'
            entry = [
                distributed_optimizer_entry(
                    [p.no_weight_decay for p in trained if (p.expert is not None) is experts],
                    state.templates,
                    step,
                    carried,
                    experts,
                )
                for experts in (False, True)
            ]
        else:
            kinds = [p.no_weight_decay for p in trained]
            entry = distributed_optimizer_entry(kinds, state.templates, step, carried)
    spec = plan.model()
    tree, slots = rank_tree(
        file,
        args=state.args,
        carried=state.carried,
        group_templates=state.templates,
        no_weight_decay=no_wd,
        optimizer_entry=entry,
        expert_kinds=group_kinds(spec, experts=True) if plan.target_layout.ep > 1 else frozenset(),
    )
    # A slot is named after the position of its first tensor; its blocks in offset order.
    by_key: dict[tuple[str | int, ...], list[TensorWrite]] = {}
    for write in file.tensors:
        by_key.setdefault(write.key, []).append(write)
    writes = {
        str(n): sorted(by_key[t.key], key=lambda w: w.view_offset or 0)
        for n, t in enumerate(file.tensors)
        if by_key[t.key][0] is t
    }
    carried_slots = state.carried_slots()

    def produce(slot: TensorSlot) -> Iterator[memoryview | Run]:
        if slot.key in writes:
            for write in writes[slot.key]:
                yield from assemble.chunks(write, file.path)
        else:
            yield state.carried_bytes(slot)

    all_slots = [*slots, *carried_slots]
    assemble.expect(w for slot in all_slots for w in writes.get(slot.key, ()))
    with ReadAhead(all_slots, produce) as ahead:
        write_torch_zip(out, tree, all_slots, ahead)
