"""An opened ``torch_dist`` checkpoint: a DCP checkpoint (its records read by the DCP reader)
whose common state (``common.pt``, or the byte item megatron-core 0.19 keeps it in) holds
Megatron's ``args``, the distributed optimizer's parameter groups and the training counters."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from ckptctl.errors import CheckpointError
from ckptctl.formats.base import SavedTraining, templates_of
from ckptctl.formats.dcp_container.checkpoint import DcpCheckpoint
from ckptctl.formats.megatron_common.args import grad_reduce_dtype
from ckptctl.formats.megatron_common.distopt_layout import is_bucket_key
from ckptctl.formats.megatron_common.sharded_keys import dense_optimizer
from ckptctl.formats.megatron_common.target_style import style_for_args
from ckptctl.formats.torch_dist.model_space import is_model_space_key
from ckptctl.formats.torchsave.archive import TensorRef
from ckptctl.model.megatron_style import GroupOrder, MegatronStyle, OptimizerLayout
from ckptctl.model.peft_wrapped import EmbeddedLora


@dataclass
class TorchDistCheckpoint(DcpCheckpoint):
    args: argparse.Namespace | None = None
    common: dict[str, Any] = field(default_factory=dict)
    common_tensors: dict[int, Any] = field(default_factory=dict)
    """Values of the tensors in ``common``'s optimizer entry, by the identity of their
    reference (``read_ref``)."""
    adapter: EmbeddedLora | None = None
    """Megatron-Bridge's LoRA adapter saved beside the base (``lora_shards``)."""

    @property
    def optimizer(self) -> OptimizerLayout | None:
        """``fully_reshardable`` state is the distributed optimizer's, per parameter: written
        to Megatron legacy as ``distrib_optim.pt`` (or per-parameter torch state without it)."""
        if not self.view.has_optimizer or self.view.spec is None or self.args is None:
            return super().optimizer
        files = self.view.files
        return OptimizerLayout(
            states=(),
            distributed=True,
            group_order=GroupOrder.DECAY_FIRST,
            overlap_grad_reduce=bool(getattr(self.args, "overlap_grad_reduce", False)),
            bucket_size=getattr(self.args, "ddp_bucket_size", None),
            grad_dtype=grad_reduce_dtype(self.args),
            buckets=any(is_bucket_key(str(t.key[0])) for f in files for t in f.tensors),
            model_space=self.view.layout.distributed_optimizer
            and any(is_model_space_key(str(t.key[0])) for f in files for t in f.tensors),
        )

    @property
    def style(self) -> MegatronStyle:
        return style_for_args(MegatronStyle(optimizer=self.optimizer), self.args)

    @property
    def dp_reshardable(self) -> bool:
        """Optimizer state saved as grad-buffer buckets that could not be placed on the model's
        parameters (the view's warning says why); placed buckets move like any state."""
        saved = any(is_bucket_key(k) for k in self.metadata.entries)
        placed = any(is_bucket_key(str(t.key[0])) for f in self.view.files for t in f.tensors)
        return saved and not placed

    def legacy_carried_state(self) -> dict[str, Any]:
        """Training state for Megatron legacy rank files: scheduler, counters, iteration, and
        what Megatron's optimizer wrapper keeps beside the torch optimizer (a grad scaler's
        loss scale and counters); what only ``torch_dist`` knows (content metadata, sharding
        type) is left behind."""
        skip = {"args", "optimizer", "rng_state", "content_metadata"}
        out = {k: v for k, v in self.common.items() if k not in skip}
        out.setdefault("checkpoint_version", 3.0)
        out["iteration"] = self.view.iteration or 0
        opt = dense_optimizer(self.common.get("optimizer"))
        if isinstance(opt.get("optimizer"), dict):  # a wrapper's entry, not torch's own
            # (``param_state``: Adam's step per parameter of a fully_sharded_model_space
            # save, which Megatron reads from the parameter groups instead)
            inner = {
                "optimizer",
                "param_state_sharding_type",
                "fp32_from_fp16_params",
                "param_state",
            }
            extra = {k: v for k, v in opt.items() if k not in inner}
            if extra:
                out["optimizer_extra"] = extra
        return out

    def read_ref(self, path: str, ref: TensorRef) -> Any:
        """A tensor inside the common state's optimizer entry (read with it)."""
        value = self.common_tensors.get(id(ref))
        if value is None:
            raise CheckpointError(
                f"{self.storage.url}: a tensor of {ref.numel} elements in the common state is "
                "not carried (only small ones are)"
            )
        return value

    def saved_training(self, path: str) -> SavedTraining:
        """``torch_dist``'s training state from its common state."""
        if self.args is None:
            return super().saved_training(path)
        step = self.view.optimizer_step if self.view.has_optimizer else None
        return SavedTraining(self.legacy_carried_state(), self.args, self.group_templates(), step)

    def group_templates(self) -> dict[bool, dict[str, Any]]:
        """Each parameter group's settings by kind (True: no weight decay), as the distributed
        optimizer's param_groups in the common state record them (Adam's step aside)."""
        if self.args is None:
            return super().group_templates()
        opt = dense_optimizer(self.common.get("optimizer"))
        # megatron-core's per-parameter optimizer keeps its groups at the top, the distributed
        # one under its torch optimizer.
        groups = opt.get("param_groups") or opt.get("optimizer", {}).get("param_groups", [])
        return templates_of(groups)
