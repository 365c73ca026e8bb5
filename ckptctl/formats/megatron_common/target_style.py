"""What a Megatron checkpoint written by ckptctl keeps of its source's style and what it takes
from its target layout: the layer spec and expert module its ``args`` call for, and the form of
the optimizer state a target layout holds. Pure."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptctl.formats.megatron_common.args import naming_from_args
from ckptctl.model.catalog import ExpertNaming
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.megatron_style import GroupOrder, MegatronStyle, OptimizerLayout


def expert_naming_from_args(args: Any) -> ExpertNaming:
    """The expert module megatron-core builds: without grouped GEMM ``SequentialMLP``; with
    it ``TEGroupedMLP`` under TransformerEngine, else (or when asked for the legacy one)
    ``GroupedMLP``."""
    if not getattr(args, "moe_grouped_gemm", False):
        return ExpertNaming.SEQUENTIAL
    if getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine" and not (
        getattr(args, "moe_use_legacy_grouped_gemm", False)
    ):
        return ExpertNaming.TE_GROUPED
    return ExpertNaming.GROUPED


def style_for_args(style: MegatronStyle, args: Any) -> MegatronStyle:
    """``style`` spelled as ``args.transformer_impl`` (and ``moe_grouped_gemm``) say
    Megatron-LM will load it (in that spec's layer order), whatever the source's own
    spelling."""
    if args is None:
        return style
    style = replace(style, expert_naming=expert_naming_from_args(args))
    naming = naming_from_args(args)
    if naming is None or naming is style.naming:
        return style
    return replace(style, naming=naming, layer_order=None)


def target_optimizer(
    source: OptimizerLayout | None, layout: ParallelLayout, weight_dtype: str
) -> OptimizerLayout | None:
    """How a target of ``layout`` stores the source's optimizer state.

    Switching between the distributed optimizer and per-parameter torch state follows
    Megatron-Core 0.16: weight-decay group first; without fp32 master copies (fp32 weights) the
    torch state dict is stored bare, as ``FP32Optimizer`` does.
    """
    if source is None:
        return None
    return replace(_target_optimizer(source, layout, weight_dtype), chained=layout.ep > 1)


def _target_optimizer(
    source: OptimizerLayout, layout: ParallelLayout, weight_dtype: str
) -> OptimizerLayout:
    if layout.distributed_optimizer:
        if source.distributed:
            return source
        return OptimizerLayout(
            states=(),
            distributed=True,
            group_order=GroupOrder.DECAY_FIRST,
            grad_dtype=source.grad_dtype,
        )
    if not source.distributed:
        return source
    master = weight_dtype != "float32"
    return OptimizerLayout(
        states=("step", "exp_avg", "exp_avg_sq"),
        master_weights=master,
        wrapped=master,
        group_order=GroupOrder.DECAY_FIRST,
        grad_dtype=source.grad_dtype,
    )
