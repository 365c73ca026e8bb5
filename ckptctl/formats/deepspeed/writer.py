"""Writing a DeepSpeed universal checkpoint (``planners.universal`` lays it out): each
parameter's fp32 weight and Adam state whole, streamed; the optimizer's global state and the
model states DeepSpeed's engine reads before them, built from what the source knows."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

from ckptctl.formats.base import WriteJob
from ckptctl.formats.deepspeed.layout import (
    PARAM_KEY,
    STEP_KEY,
    UNIVERSAL_MODEL_STATES,
    UNIVERSAL_OPTIMIZER_STATE,
)
from ckptctl.formats.torchsave.zip_writer import TensorSlot, write_torch_zip
from ckptctl.io.byte_streams import ByteStream
from ckptctl.model.plan import FileWrite

DS_VERSION = "0.19.8"
"""The DeepSpeed release whose universal layout this writes (its loader checks a version)."""
UNIVERSAL_VERSION = 0.2
ADAM_SETTINGS = frozenset(
    {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
     "differentiable", "fused", "decoupled_weight_decay", "bias_correction"}
)  # fmt: skip
"""Parameter-group settings a torch Adam(W) under DeepSpeed understands; Megatron's own
(``wd_mult``, ``max_lr``, ...) stay behind."""


def write_universal_file(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    if file.tensors:
        (tensor,) = file.tensors
        slot = TensorSlot("0", tensor.dtype, tensor.shape)
        tree: Any = slot if tuple(tensor.key) == STEP_KEY else {PARAM_KEY[0]: slot}
        write_torch_zip(out, tree, [slot], lambda _: job.assemble.chunks(tensor, file.path))
        return
    owner, template = job.source.owner(job.plan.source_files[0])
    if file.path.endswith(UNIVERSAL_OPTIMIZER_STATE):
        step = owner.view.optimizer_step
        groups = _param_groups(owner, template)
        slots = []
        tree = {"ds_version": DS_VERSION, "param_groups": groups}
        if step is not None:
            # ZeRO 3's loader takes Adam's step from here; stages 1 and 2 from each step.pt.
            slot = TensorSlot("step", "float32", ())
            slots.append(slot)
            tree["optimizer_state_dict"] = {"state": {0: {"step": slot}}, "param_groups": groups}

        def produce(_: TensorSlot) -> Iterator[bytes]:
            yield struct.pack("<f", float(step or 0))

        write_torch_zip(out, tree, slots, produce)
    elif file.path.rsplit("/", 1)[-1] in UNIVERSAL_MODEL_STATES:
        write_torch_zip(out, _model_states(job, owner), [], lambda _: iter(()))
    else:
        raise ValueError(f"{file.path}: not a file of a universal checkpoint")


def _param_groups(owner: Any, template: str) -> list[dict[str, Any]]:
    """The source's parameter groups, in the order its training framework made them: DeepSpeed
    keeps its own; Megatron and DCP sources give decay then no-decay settings (the HF Trainer's
    order); a source without optimizer state gives two groups without settings (the engine
    keeps its own)."""
    if (groups := owner.param_groups()) is not None:
        return groups
    saved = owner.saved_training(template)
    templates = saved.templates if saved is not None else {}
    groups = []
    for no_decay in (False, True):
        if no_decay in templates:
            settings = {k: v for k, v in templates[no_decay].items() if k in ADAM_SETTINGS}
            groups.append({**settings, "params": []})
    return groups or [{"params": []}, {"params": []}]


def _model_states(job: WriteJob, owner: Any) -> dict[str, Any]:
    """What DeepSpeed's engine reads from ``mp_rank_00_model_states.pt`` before the universal
    files: counters and world sizes (weights come from ``zero/``, so ``module`` stays empty)."""
    plan = job.plan
    kept = owner.universal_model_state()
    iteration = plan.iteration or 0
    return {
        "module": {},
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": kept.get("param_shapes", []),
        "frozen_param_shapes": kept.get("frozen_param_shapes", {}),
        "shared_params": kept.get("shared_params", {}),
        "frozen_param_fragments": None,
        "lr_scheduler": kept.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": kept.get("skipped_steps", 0),
        "global_steps": iteration,
        "global_samples": kept.get("global_samples", iteration),
        "dp_world_size": plan.source_layout.dp,
        "mp_world_size": 1,
        "ds_config": {},
        "ds_version": DS_VERSION,
        "universal_checkpoint_info": {"universal_checkpoint_version": UNIVERSAL_VERSION},
    }
