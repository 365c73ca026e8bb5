"""Saving and loading Megatron checkpoints the way Megatron-LM does, for the megatron-core oracle
scripts that build models of their own (``megatron_core_gdn.py``,
``megatron_bridge_gemma3.py``): a trained rank's legacy or ``torch_dist`` save, and a TP1 PP2
legacy checkpoint loaded strictly stage by stage and run. Imported as a sibling module (the
scripts' directory is ``sys.path[0]``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_cpu import ITERATION, TRUE_VOCAB


def save_trained(
    out_dir: Path, rank: int, ckpt_format: str, state: dict[str, Any], model: Any, optimizer: Any
) -> None:
    """``state`` (args, counters, scheduler) with the model's and the optimizer's state, saved
    as Megatron-LM's ``save_checkpoint`` would: ``model_optim_rng.pt`` per rank (legacy), or
    ``dist_checkpointing.save`` of the sharded state dicts (``torch_dist``)."""
    if ckpt_format == "legacy":
        rank_dir = out_dir / f"iter_{ITERATION:07d}" / f"mp_rank_{rank:02d}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        state["model"] = model.state_dict_for_save_checkpoint()
        state["optimizer"] = optimizer.state_dict()
        torch.save(state, rank_dir / "model_optim_rng.pt")
        return
    from megatron.core import dist_checkpointing

    checkpoint_dir = out_dir / f"iter_{ITERATION:07d}"
    if rank == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state["model"] = model.sharded_state_dict()
    state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    dist_checkpointing.save(state, str(checkpoint_dir))


def pp2_logits(
    ckpt: Path, build_stage: Callable[[int], torch.nn.Module], inputs: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """The logits (true vocabulary) of a legacy TP1 PP2 checkpoint (any iteration, or
    ``release`` as one made from HF is) run stage by stage: each stage built by
    ``build_stage(stage)`` loads its file with ``load_state_dict(strict=True)``, whose keys must
    come in megatron-core's own order (the order Megatron numbers optimizer state by);
    ``inputs`` are the model's (ids, positions, mask)."""
    (iteration,) = [*ckpt.glob("iter_*"), *ckpt.glob("release")]
    stages = []
    for stage in range(2):
        model = build_stage(stage)
        path = iteration / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        assert state["args"].pipeline_model_parallel_size == 2
        model.load_state_dict(state["model"], strict=True)
        ours = [k for k in state["model"] if not k.endswith("_extra_state")]
        theirs = [k for k in model.state_dict() if not k.endswith("_extra_state")]
        assert ours == theirs, (ours, theirs)
        stages.append(model.eval())
    with torch.no_grad():
        hidden = stages[0](*inputs)
        stages[1].set_input_tensor(hidden)
        logits = stages[1](*inputs)
    return logits[..., :TRUE_VOCAB].float().contiguous()
