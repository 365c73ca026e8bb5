"""verl's FSDP checkpoints (``FSDPCheckpointManager.save_checkpoint``): per rank R of W,
``model_world_size_W_rank_R.pt`` (``model.state_dict()`` of the FSDP model: DTensor shards),
``optim_world_size_W_rank_R.pt`` (``optimizer.state_dict()``: state by parameter index) and
``extra_state_world_size_W_rank_R.pt`` (scheduler, RNG); ``fsdp_config.json`` (FSDP version,
world size) and ``huggingface/`` (the model's config.json, tokenizer) beside them, in
``global_step_N/actor`` (or ``critic``). Pure."""

from __future__ import annotations

import json
import re

from ckptctl.errors import CheckpointError

MODEL = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")
OPTIM = re.compile(r"optim_world_size_(\d+)_rank_(\d+)\.pt")
EXTRA = re.compile(r"extra_state_world_size_(\d+)_rank_(\d+)\.pt")
FSDP_CONFIG = "fsdp_config.json"
DIST_CKPT = "dist_ckpt"
"""A Megatron actor's ``torch_dist`` directory (``MegatronCheckpointManager``; the
``torch_dist`` format reads it)."""
HF_DIR = "huggingface"
ADAPTER_DIR = "adapter_checkpoint"
"""A Megatron actor trained with LoRA: Megatron-Bridge's adapter, per rank (the base is not
saved; ``ckptctl.lora.megatron`` reads it)."""
STEP = re.compile(r"global_step_(\d+)")
LORA_META = "lora_train_meta.json"
"""A LoRA run's ``{"r", "lora_alpha", "task_type"}`` (verl 0.9's ``_save_lora_train_meta``)."""


def recognised(names: frozenset[str]) -> bool:
    return any(MODEL.fullmatch(n) for n in names) or megatron_actor(names) or ADAPTER_DIR in names


def megatron_actor(names: frozenset[str]) -> bool:
    """A Megatron actor's directory: ``dist_ckpt/`` with ``huggingface/`` beside it (read by
    the ``torch_dist`` format, ``torch_dist.verl_actor``; here only its refusals)."""
    return DIST_CKPT in names and HF_DIR in names


def world_size(names: frozenset[str], where: str) -> int:
    """The one world size the model files are saved at."""
    sizes = {int(m.group(1)) for n in names if (m := MODEL.fullmatch(n))}
    if len(sizes) != 1:
        raise CheckpointError(
            f"{where}: model files of world sizes {sorted(sizes)} side by side; keep one "
            "run's files per directory"
        )
    return sizes.pop()


def model_file(world: int, rank: int) -> str:
    return f"model_world_size_{world}_rank_{rank}.pt"


def optim_file(world: int, rank: int) -> str:
    return f"optim_world_size_{world}_rank_{rank}.pt"


def extra_file(world: int, rank: int) -> str:
    return f"extra_state_world_size_{world}_rank_{rank}.pt"


def fsdp_config_text(world: int) -> str:
    """``fsdp_config.json`` as verl's ``FSDPCheckpointManager`` writes it."""
    return json.dumps({"FSDP_version": 2, "world_size": world}, indent=4)


def step_of(url: str) -> int | None:
    """The training step a ``global_step_N`` directory in the path names."""
    found = STEP.findall(url)
    return int(found[-1]) if found else None
