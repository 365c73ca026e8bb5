"""How a Megatron checkpoint spells and orders what it stores, kept when writing a new layout:
the key naming of its layer spec, the order of its layers, expert naming, and the form of its
optimizer state. Pure vocabulary shared by the Megatron-family formats and the planners."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ckptctl.model.catalog import ExpertNaming, Naming


class GroupOrder(StrEnum):
    """Order of Megatron's parameter groups (weight decay / none) in the torch optimizer."""

    APPEARANCE = "appearance"
    """Groups in order of their first parameter (Megatron-Core before 0.16)."""
    DECAY_FIRST = "decay-first"
    """Sorted so the weight-decay group comes first (Megatron-Core 0.16)."""


@dataclass(frozen=True, slots=True)
class OptimizerLayout:
    """The non-distributed optimizer state a rank file holds per parameter."""

    states: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "step")
    """Keys of each parameter's torch optimizer state, in stored order."""
    master_weights: bool = True
    """Mixed precision: fp32 copies in ``fp32_from_fp16_params``; else the weight is the master."""
    group_order: GroupOrder = GroupOrder.APPEARANCE
    wrapped: bool = True
    """Megatron's mixed-precision optimizer nests the torch state dict under ``optimizer``;
    its ``FP32Optimizer`` stores the bare torch state dict."""
    distributed: bool = False
    """State in ``distrib_optim.pt`` flat buffers (fp32 master as ``param``) instead of per
    parameter in ``model_optim_rng.pt``."""
    chained: bool = False
    """Two optimizers, dense then expert-parallel parameters (megatron-core's ``ChainedOptimizer``
    under EP > 1): ``optimizer`` is a list of their state dicts, each numbered from 0."""
    grad_dtype: str | None = None
    """The dtype the grad buffers reduce in, when not fp32 (``args.grad_reduce_dtype``): the
    second dtype of each distributed-optimizer buffer's key."""
    buckets: bool = False
    """``torch_dist``: the distributed optimizer's state is kept as its grad-buffer buckets
    (Megatron's ``dp_reshardable``) rather than per parameter (``fully_reshardable``)."""
    model_space: bool = False
    """``torch_dist``: per parameter, but N-D flattened, as megatron-core <= 0.14 kept it by
    default (``fully_sharded_model_space``)."""
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None
    """``--ddp-bucket-size``; with overlap on and none given Megatron uses max(40M, 1M * dp)."""

    @property
    def torch_state(self) -> tuple[str | int, ...]:
        """Key path of the (first) torch optimizer state dict inside a rank file."""
        return self.sub_state(0)

    def sub(self, index: int) -> tuple[str | int, ...]:
        """Key path of sub-optimizer ``index``'s state dict (the wrapper, if wrapped)."""
        return ("optimizer", index) if self.chained else ("optimizer",)

    def sub_state(self, index: int) -> tuple[str | int, ...]:
        """Key path of sub-optimizer ``index``'s torch state dict."""
        return (*self.sub(index), "optimizer") if self.wrapped else self.sub(index)


TORCH_ADAM = OptimizerLayout(
    states=("step", "exp_avg", "exp_avg_sq"),
    master_weights=False,
    wrapped=False,
    group_order=GroupOrder.DECAY_FIRST,
)
"""An HF model under torch's Adam (FSDP, verl, the HF Trainer): per-parameter step and
moments, the fp32 weights their own masters, as Megatron's ``FP32Optimizer`` stores them."""


@dataclass(frozen=True, slots=True)
class MegatronStyle:
    """How a Megatron checkpoint spells and orders things, kept when writing a new layout."""

    naming: Naming = Naming.TE
    layer_order: tuple[str, ...] | None = None
    optimizer: OptimizerLayout | None = None
    expert_naming: ExpertNaming = ExpertNaming.SEQUENTIAL
    mtp_inner: str = "mtp_model_layer"
    """The module legacy files keep an MTP layer's transformer layer under: megatron-core 0.17
    on names it ``mtp_model_layer``, earlier releases ``transformer_layer``."""
