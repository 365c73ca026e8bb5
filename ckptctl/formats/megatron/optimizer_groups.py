"""The optimizer state of Megatron legacy rank files: which layout the files use (torch state,
wrapped or bare, chained for experts, or the distributed optimizer), the order of Megatron's
parameter groups, and Adam's step."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from ckptctl.errors import CheckpointError
from ckptctl.formats.megatron_common.args import grad_reduce_dtype
from ckptctl.formats.megatron_common.layout import (
    group_kinds,
    param_groups,
    rank_params,
    sub_optimizers,
)
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.formats.torchsave.refs import resolve
from ckptctl.model.catalog import ExpertNaming, Naming
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import GroupOrder, OptimizerLayout


def optimizer_layout(tree: dict[str, Any], args: argparse.Namespace) -> OptimizerLayout | None:
    opt: Any = tree.get("optimizer")
    chained = isinstance(opt, list) and bool(opt) and all(isinstance(o, dict) for o in opt)
    if chained:  # megatron-core's ChainedOptimizer: dense then expert-parallel parameters
        opt = opt[0]
    if not isinstance(opt, dict):
        return None
    if getattr(args, "use_distributed_optimizer", False):
        return OptimizerLayout(
            states=(),
            master_weights=True,
            wrapped=True,
            distributed=True,
            group_order=GroupOrder.DECAY_FIRST,
            overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
            bucket_size=getattr(args, "ddp_bucket_size", None),
            chained=chained,
            grad_dtype=grad_reduce_dtype(args),
        )
    wrapped = isinstance(opt.get("optimizer"), dict)
    inner = opt["optimizer"] if wrapped else opt
    state = inner.get("state")
    if not state:
        return None
    first = state[min(state)]
    states = tuple(k for k, v in first.items() if isinstance(v, TensorRef))
    return OptimizerLayout(
        states=states,
        master_weights="fp32_from_fp16_params" in opt,
        wrapped=wrapped,
        chained=chained,
        grad_dtype=grad_reduce_dtype(args),
    )


def optimizer_step(reader: TorchZipReader, optimizer: OptimizerLayout | None) -> float | None:
    """Adam's step count: per parameter group (distributed) or per parameter (torch state)."""
    if optimizer is None:
        return None
    torch_state = resolve(reader.tree, optimizer.torch_state)
    for group in torch_state.get("param_groups", []):
        if "step" in group:
            return float(group["step"])
    for state in torch_state.get("state", {}).values():
        step = state.get("step")
        if isinstance(step, TensorRef):
            return reader.read_number(step)
        if step is not None:
            return float(step)
    return None


def _group_kind(group: dict[str, Any]) -> bool | None:
    """Whether a stored parameter group is the no-weight-decay one, when it says so."""
    if "wd_mult" in group:
        return group["wd_mult"] == 0
    return None


def match_groups(
    spec: ModelSpec,
    layout: ParallelLayout,
    style: tuple[Naming, tuple[str, ...] | None, ExpertNaming, str],
    optimizer: OptimizerLayout,
    trees: dict[tuple[int, int, int], dict[str, Any]],
) -> tuple[OptimizerLayout, dict[bool, dict[str, Any]]]:
    """Find the parameter-group order every rank file follows, and each group's settings
    (the dense optimizer's, under a chained one).

    Megatron-Core changed the order in 0.16 (weight-decay group first); we try both and take the
    one whose group sizes and ``wd_mult`` agree with every file.
    """
    naming, layer_order, expert_naming, mtp_inner = style
    for order in _orders(trees, optimizer):
        templates: dict[bool, dict[str, Any]] = {}
        fits = True
        for (tp_rank, pp_rank, ep_rank), tree in trees.items():
            params = rank_params(
                spec, layout, pp_rank, naming, layer_order, ep_rank, expert_naming, mtp_inner
            )
            for sub, members in enumerate(sub_optimizers(params, optimizer.chained)):
                try:
                    stored = resolve(tree, optimizer.sub_state(sub))["param_groups"]
                except (KeyError, IndexError, TypeError):
                    form = "distributed optimizer's" if optimizer.distributed else "torch"
                    raise CheckpointError(
                        f"the optimizer state of rank (tp, pp, ep) = ({tp_rank}, {pp_rank}, "
                        f"{ep_rank}) is not the {form} layout its args announce "
                        "(use_distributed_optimizer, expert parallelism); cannot map it"
                    ) from None
                aligned = group_kinds(spec, experts=sub == 1)
                expected = param_groups(params, order, members, aligned)
                fits = len(stored) == len(expected) and all(
                    len(group.get("params", group_members)) == len(group_members)
                    and _group_kind(group) in (None, kind)
                    for group, (kind, group_members) in zip(stored, expected, strict=True)
                )
                if not fits:
                    break
                for group, (kind, _) in zip(stored, expected, strict=True):
                    templates.setdefault(kind, {k: v for k, v in group.items() if k != "params"})
            if not fits:
                break
        if fits:
            return replace(optimizer, group_order=order), templates
    raise CheckpointError(
        "the optimizer's parameter groups match neither of Megatron's orders (weight decay / no "
        "weight decay by first appearance, or weight decay first); cannot map its state"
    )


def _orders(
    trees: dict[tuple[int, int, int], dict[str, Any]], optimizer: OptimizerLayout
) -> list[GroupOrder]:
    """The orders to try, the likelier first: where both fit (a stage whose first parameter
    takes weight decay, as every one-stage model's embedding does) the first one is kept and
    decides how other stage splits are written. Megatron-Core 0.16 sorts the groups (weight
    decay first) and marks each ``default_config``; earlier releases neither."""
    for tree in trees.values():
        try:
            groups = resolve(tree, optimizer.sub_state(0))["param_groups"]
        except (KeyError, IndexError, TypeError):
            continue
        if any(isinstance(g, dict) and "default_config" in g for g in groups):
            return [GroupOrder.DECAY_FIRST, GroupOrder.APPEARANCE]
        break
    return [GroupOrder.APPEARANCE, GroupOrder.DECAY_FIRST]


def carried_state(tree: dict[str, Any]) -> dict[str, Any]:
    """Training state a rank file carries besides model and optimizer tensors, without its RNG
    state (which belongs to its rank: ``SavedTraining.rng_state``)."""
    skip = {"args", "checkpoint_version", "iteration", "optimizer", "rng_state"}
    out = {k: v for k, v in tree.items() if k not in skip and not str(k).startswith("model")}
    out["checkpoint_version"] = tree.get("checkpoint_version", 3.0)
    out["iteration"] = tree.get("iteration", 0)
    opt = tree.get("optimizer")
    if isinstance(opt, list) and opt:  # chained: the dense optimizer's extras stand for all
        opt = opt[0]
    if isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict):
        out["optimizer_extra"] = {
            k: v for k, v in opt.items() if k not in ("optimizer", "fp32_from_fp16_params")
        }
    return out
