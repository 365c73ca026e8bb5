"""Megatron-Bridge's own ``save_checkpoint`` (``megatron.bridge.training.checkpointing``) for the
CPU oracles: a megatron-core model saved as a Megatron-Bridge training run saves it, with its
``ConfigContainer`` (the model's provider among it) in ``run_config.yaml`` and no Megatron-LM
``args`` (issue 56: what users training the 2026 families with Megatron-Bridge hold).

Megatron-Bridge 0.3.1's wheel is pure Python; its dependencies cannot all be installed here
(TransformerEngine built for CUDA, transformers < 5, ModelOpt, ...). It is imported from the
directory ``tests/megatron_bridge_peft.site`` installs it to, with ``omegaconf`` (and its
``antlr4`` runtime) from directories of their own, and these import shims, none touching what is
saved:

* ``transformer_engine`` and megatron-core's TransformerEngine extension are stand-in modules
  whose every attribute is an empty module class (megatron-core's own modules were imported
  first, so they keep their non-TE paths);
* ``triton``, ``datasets``, ``modelopt`` and ``torch.utils.tensorboard`` are stand-ins that are
  imported and never called (the SFT dataset, the ModelOpt state and TensorBoard are not used:
  ``save_checkpoint`` skips ModelOpt for a model without it);
* ``torch.cuda.get_rng_state`` gives the CPU generator's state (the saved RNG state's
  ``cuda_rng_state``, which ckptctl carries as it is).

The model is the caller's (built for CPU as the oracle builds it); the provider in the config
must describe it: ``save_checkpoint`` writes the config as given.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

import torch


class _Loose:
    """Anything: called on a function it returns the function (``@triton.jit``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __getitem__(self, key: Any) -> Any:
        return self


class _LooseModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Loose()


class _ClassModule(types.ModuleType):
    """Every attribute an empty module class: enough for class definitions and isinstance
    checks, which then match nothing."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        made = type(name, (torch.nn.Module,), {})
        setattr(self, name, made)
        return made


def import_bridge(site: Path, deps: list[Path]) -> None:
    """Make ``megatron.bridge`` importable from ``site`` (see the module's shims)."""
    importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    importlib.import_module("megatron.core.models.gpt.moe_module_specs")
    for path in (site, *deps):
        sys.path.insert(0, str(path))
    bridge = types.ModuleType("megatron.bridge")
    bridge.__path__ = [str(site / "megatron" / "bridge")]
    sys.modules["megatron.bridge"] = bridge
    te, te_torch = _ClassModule("transformer_engine"), _ClassModule("transformer_engine.pytorch")
    te_torch.ops = _ClassModule("transformer_engine.pytorch.ops")  # type: ignore[attr-defined]
    te.pytorch = te_torch  # type: ignore[attr-defined]
    stand_ins: dict[str, types.ModuleType] = {
        "transformer_engine": te,
        "transformer_engine.pytorch": te_torch,
        "megatron.core.extensions.transformer_engine": _ClassModule(
            "megatron.core.extensions.transformer_engine"
        ),
    }
    for name in ("triton", "triton.language", "torch.utils.tensorboard",
                 "torch.utils.tensorboard.writer", "datasets", "modelopt", "modelopt.torch",
                 "modelopt.torch.opt", "modelopt.torch.opt.plugins"):  # fmt: skip
        stand_ins[name] = _LooseModule(name)
        stand_ins[name].__path__ = []  # type: ignore[attr-defined]
    sys.modules.update(stand_ins)


def model_fields(num_layers: int, tp: int) -> dict[str, Any]:
    """Megatron-Bridge provider fields for ``mcore_cpu``'s model: its sizes, the true
    vocabulary padded as Megatron-LM pads it, untied embeddings, RMSNorm, SwiGLU, RoPE, fp32
    parameters (the oracles' variants override what they change)."""
    from mcore_cpu import (
        FFN_HIDDEN,
        HIDDEN,
        KV_CHANNELS,
        MAKE_VOCAB_DIVISIBLE_BY,
        MAX_POSITIONS,
        NORM_EPS,
        NUM_HEADS,
        NUM_QUERY_GROUPS,
        ROTARY_BASE,
        TRUE_VOCAB,
    )

    return {
        "num_layers": num_layers,
        "hidden_size": HIDDEN,
        "ffn_hidden_size": FFN_HIDDEN,
        "num_attention_heads": NUM_HEADS,
        "num_query_groups": NUM_QUERY_GROUPS,
        "kv_channels": KV_CHANNELS,
        "vocab_size": TRUE_VOCAB,
        "should_pad_vocab": True,
        "make_vocab_size_divisible_by": MAKE_VOCAB_DIVISIBLE_BY,
        "share_embeddings_and_output_weights": False,
        "normalization": "RMSNorm",
        "layernorm_epsilon": NORM_EPS,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "position_embedding_type": "rope",
        "rotary_base": ROTARY_BASE,
        "seq_length": MAX_POSITIONS,  # GPTModel's max_sequence_length
        "tensor_model_parallel_size": tp,
        "bf16": False,
        "params_dtype": torch.float32,
    }


def _ddp_fields(model: Any) -> dict[str, Any]:
    """The grad-buffer settings of megatron-core's ``DistributedDataParallel`` ``model`` (none
    for a bare module)."""
    config = getattr(model, "ddp_config", None)
    if config is None:
        return {}
    fields = ("grad_reduce_in_fp32", "overlap_grad_reduce", "bucket_size")
    return {name: getattr(config, name) for name in fields}


def save_with_bridge(
    out_dir: Path,
    provider: str,
    fields: dict[str, Any],
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    iteration: int,
    distributed: str | None = None,
) -> None:
    """Save ``model`` (unwrapped or DDP), ``optimizer`` and ``scheduler`` to ``out_dir`` with
    Megatron-Bridge's ``save_checkpoint`` at step ``iteration``, ``torch_dist``, its config's
    model the provider class ``provider`` (``module.Class`` under ``megatron.bridge.models``)
    made with ``fields``; ``distributed``: the optimizer is megatron-core's distributed one (as
    the caller built it), its state saved ``dp_reshardable`` (Megatron-Bridge's default) or
    ``fully_reshardable`` (``checkpoint.dist_ckpt_optim_fully_reshardable``)."""
    from megatron.bridge.training import config as bridge_config
    from megatron.bridge.training.checkpointing import save_checkpoint
    from megatron.bridge.training.state import GlobalState
    from megatron.core.optimizer import OptimizerConfig

    module, name = provider.rsplit(".", 1)
    provider_class = getattr(importlib.import_module(f"megatron.bridge.models.{module}"), name)
    cfg = bridge_config.ConfigContainer(
        train=bridge_config.TrainingConfig(train_iters=10, global_batch_size=2, micro_batch_size=2),
        model=provider_class(**fields),
        optimizer=OptimizerConfig(
            optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed is not None
        ),
        # the DDP settings the model's grad buffers were built with, as a run's config holds
        # the ones its DistributedDataParallel was built from
        ddp=bridge_config.DistributedDataParallelConfig(
            use_distributed_optimizer=distributed is not None, **_ddp_fields(model)
        ),
        scheduler=bridge_config.SchedulerConfig(),
        dataset=bridge_config.GPTDatasetConfig(
            random_seed=1,
            sequence_length=16,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        ),
        logger=bridge_config.LoggerConfig(),
        tokenizer=bridge_config.TokenizerConfig(),
        checkpoint=bridge_config.CheckpointConfig(
            save=str(out_dir),
            ckpt_format="torch_dist",
            fully_parallel_save=False,
            dist_ckpt_optim_fully_reshardable=distributed == "fully_reshardable",
        ),
    )
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    state = GlobalState()
    state.cfg = cfg
    state.train_state.step = iteration
    save_checkpoint(state, [model], optimizer, scheduler, num_floating_point_operations_so_far=0)
