"""Refusals of what a job is asked that its source or target cannot do: a flag that would
change nothing or could not be honoured is refused by name before anything is read or
written, never ignored."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptctl.errors import UsageError
from ckptctl.model.target import FP8_BLOCK, MXFP4

if TYPE_CHECKING:
    from ckptctl.formats.base import Checkpoint
    from ckptctl.formats.target import TargetFormat


def refuse_dp_reshardable(ckpt: Checkpoint) -> None:
    """``dp_reshardable`` optimizer state is raw grad-buffer buckets of one TP/PP/DP layout,
    which only Megatron itself loads, and only at that layout."""
    if ckpt.dp_reshardable:
        raise UsageError(
            f"{ckpt.storage.url}: optimizer state is dp_reshardable (grad-buffer buckets of the "
            f"saved {ckpt.view.layout.describe()} layout) that could not be placed on the "
            "model's parameters (see the warning), so it cannot move; re-save it with "
            "--dist-ckpt-optim-fully-reshardable (Megatron-Bridge: "
            "checkpoint.dist_ckpt_optim_fully_reshardable: true), or take the weights alone "
            "with consolidate --format hf"
        )


def refuse_needless_rounding(ckpt: Checkpoint, fmt: str) -> None:
    """``--allow-rounding`` where nothing is stored shifted, neither the source read nor the
    target written: a flag that would change nothing is refused, not ignored."""
    if not any(t.shift for f in ckpt.view.files for t in f.tensors):
        raise UsageError(
            f"--allow-rounding: neither this source nor --format {fmt} of this model stores a "
            "weight shifted from another's (only HF's Qwen3.5-style gated norms are)"
        )


def refuse_unwritable_dtype(dtype: str | None, target: TargetFormat) -> None:
    """``--dtype fp8-block`` asks for a format that writes block-scaled FP8."""
    if dtype in (FP8_BLOCK, MXFP4) and not target.block_quantized:
        what = "block-scaled FP8" if dtype == FP8_BLOCK else "MXFP4"
        raise UsageError(
            f"--dtype {dtype}: --format {target.name} cannot hold {what}; "
            "consolidate --format hf writes it"
        )


def refuse_unmeshed(shard_group: int | None, target: TargetFormat) -> None:
    """``--fsdp-size`` sets the device mesh of a target that writes DTensors on one."""
    if shard_group is not None and not target.meshed:
        raise UsageError(
            f"--fsdp-size {shard_group}: --format {target.name} places no tensor on a device "
            "mesh; it sets the HSDP shard groups of --format verl"
        )
