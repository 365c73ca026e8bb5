"""The training state of a synthetic Megatron-LM rank file: Megatron's non-distributed
optimizer state (S4.8), the scheduler's state and the RNG states. Part of the test oracle:
imports only torch and numpy (see ``ckptctl.synth``)."""

from __future__ import annotations

import random

import numpy
import torch

from ckptctl.synth.model import _ADAM_BETAS, _ADAM_EPS, _RNG_SEED, _WEIGHT_DECAY


def _rng_state() -> list[dict[str, object]]:
    # Seeded private generators, not the process-global ones: files must be byte-reproducible.
    return [
        {
            "random_rng_state": random.Random(_RNG_SEED).getstate(),
            "np_rng_state": numpy.random.RandomState(_RNG_SEED).get_state(),
            "torch_rng_state": torch.Generator().manual_seed(_RNG_SEED).get_state(),
            "cuda_rng_state": None,
            "rng_tracker_states": {},
        }
    ]


def _opt_param_scheduler(iteration: int) -> dict[str, object]:
    return {
        "max_lr": 1e-3,
        "lr_warmup_steps": 0,
        "num_steps": iteration,
        "lr_decay_style": "cosine",
        "lr_decay_steps": 1000,
        "min_lr": 1e-5,
        "start_wd": 0.0,
        "end_wd": 0.0,
        "wd_incr_style": "constant",
        "wd_incr_steps": 1000,
    }


def _param_group(no_wd: bool, params: list[int]) -> dict[str, object]:
    return {
        "lr": 1e-3,
        "betas": _ADAM_BETAS,
        "eps": _ADAM_EPS,
        "weight_decay": 0.0 if no_wd else _WEIGHT_DECAY,
        "amsgrad": False,
        "foreach": None,
        "maximize": False,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "wd_mult": 0.0 if no_wd else 1.0,
        "lr_mult": 1.0,
        "is_expert_parallel": False,
        "is_decoupled_lr": False,
        "params": params,
    }


def _optimizer_state(
    chunks: list[dict[str, torch.Tensor]],
    chunk_states: list[dict[str, dict[str, torch.Tensor]]],
    params_dtype: torch.dtype,
    param_group_order: str,
) -> dict[str, object]:
    """Megatron's non-distributed optimizer state for one rank file (S4.8).

    Megatron walks ``named_parameters()`` of every model chunk in order and puts a parameter in
    the no-weight-decay group iff it is a bias or 1-D. Group order: by first appearance
    (``"appearance"``, megatron-core up to ~0.15, ``params_map`` insertion order) or the default
    (weight-decay) group first (``"wd_first"``: megatron-core 0.16 sorts the group keys with the
    override-free key first; pre-core Megatron-LM also appended the weight-decay group first).
    torch numbers the parameters consecutively over the groups in group order.
    """
    groups: dict[bool, list[tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {}
    if param_group_order == "wd_first":
        groups[False] = []
    for weights, states in zip(chunks, chunk_states, strict=True):
        for name, weight in weights.items():
            no_wd = name.endswith(".bias") or weight.dim() == 1
            groups.setdefault(no_wd, []).append((weight, states[name]))
    groups = {no_wd: members for no_wd, members in groups.items() if members}
    state: dict[int, dict[str, torch.Tensor]] = {}
    param_groups: list[dict[str, object]] = []
    masters: list[list[torch.Tensor]] = []
    index = 0
    for no_wd, members in groups.items():
        indices: list[int] = []
        group_masters: list[torch.Tensor] = []
        for _, st in members:
            state[index] = {
                "step": st["step"].clone(),
                "exp_avg": st["exp_avg"],
                "exp_avg_sq": st["exp_avg_sq"],
            }
            group_masters.append(st["fp32_param"])
            indices.append(index)
            index += 1
        param_groups.append(_param_group(no_wd, indices))
        masters.append(group_masters)
    torch_state: dict[str, object] = {"state": state, "param_groups": param_groups}
    if params_dtype == torch.float32:
        # FP32Optimizer.state_dict() is the bare torch optimizer state dict.
        return torch_state
    # Float16OptimizerWithFloat16Params; bf16 has no grad scaler, so no 'grad_scaler' key.
    return {"optimizer": torch_state, "fp32_from_fp16_params": masters}
