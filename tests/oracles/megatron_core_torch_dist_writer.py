"""Write tiny Megatron ``torch_dist`` checkpoints with megatron-core's own code.

Test oracle for ``ckptctl``: a real third-party writer of Megatron-Core's distributed checkpoint
format (a PyTorch DCP directory plus Megatron's ``common.pt`` / ``metadata.json``). It spawns
``TP = 2`` CPU processes (gloo backend, PP = DP = 1), builds megatron-core's own ``GPTModel``
(local layer spec, no TransformerEngine) configured Llama-style (RMSNorm, SwiGLU, RoPE, GQA with
4 heads / 2 query groups, no biases, untied embeddings, fp32, CPU initialisation) and writes::

    OUT_DIR/ckpt/latest_checkpointed_iteration.txt        "1"
    OUT_DIR/ckpt/iter_0000001/metadata.json               {"sharded_backend": "torch_dist", ...}
    OUT_DIR/ckpt/iter_0000001/common.pt                   non-sharded state (args, iteration, ...)
    OUT_DIR/ckpt/iter_0000001/.metadata                   pickled DCP Metadata
    OUT_DIR/ckpt/iter_0000001/__<rank>_<i>.distcp         tensors + byte items (rng_state)
    OUT_DIR/ckpt_optim/...                                same layout, after one Adam step, with
                                                          DistributedOptimizer state
                                                          (``fully_reshardable``)
    OUT_DIR/ckpt_optim_dp_reshardable/...                 the same state as ``dp_reshardable``
                                                          (only with ``--optim-sharding ...
                                                          dp_reshardable``)
    OUT_DIR/logits.pt                                     {"input_ids", "logits", ...}

``ckpt`` is the freshly initialised model saved as Megatron-LM's ``save_checkpoint`` does for
``--ckpt-format torch_dist --no-save-optim`` (model + RNG, no optimizer / scheduler).
``ckpt_optim`` is the same model wrapped in megatron-core's ``DistributedDataParallel`` and
``DistributedOptimizer`` (through ``get_megatron_optimizer``), after ONE training step through
megatron-core's schedule, saved as ``--ckpt-format torch_dist --use-distributed-optimizer
--dist-ckpt-optim-fully-reshardable`` does: the content metadata carries
``distrib_optim_sharding_type = "fully_reshardable"``, and the optimizer's fp32 master weights
and Adam moments are stored as ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`` with
the same global shapes and boxes as the model tensors. ``ckpt_optim_dp_reshardable`` is what
plain ``--use-distributed-optimizer`` saves (Megatron-LM's default sharding type,
``dp_reshardable``): the DistributedOptimizer's raw grad-buffer buckets, one flat tensor per
(TP/PP group, bucket, state) named
``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_(...).bucket_idx_<i>.<state>``,
reshardable over DP only.

``--load CKPT_DIR [--with-optimizer]`` turns the script into a reader: megatron-core's
``dist_checkpointing.load`` of a TP=2 ``torch_dist`` checkpoint into a freshly initialised
GPTModel (another seed), as Megatron-LM's ``load_checkpoint`` does with ``--no-load-rng``
(optimizer and scheduler too with ``--with-optimizer``). It writes ``OUT_DIR/logits.pt``
(``{"input_ids", "logits"}`` of the loaded model), ``OUT_DIR/load_report.json``
(``{"unexpected_keys", "missing_keys"}`` in megatron-core's sense: keys the model asked for
that the checkpoint lacks, which Megatron-LM's default ``--dist-ckpt-strictness`` refuses, and
keys the checkpoint has that nobody asked for) and ``OUT_DIR/ckpt``: what megatron-core holds
after the load, saved again by megatron-core.

``megatron.training`` is not installed (and needs CUDA), so its ``save_checkpoint``,
``generate_state_dict``, ``get_rng_state`` and ``_build_sharded_state_dict_metadata`` are
mirrored here. The top-level state dict is ``{"args", "checkpoint_version": 3.0, "iteration",
"model", ["optimizer", "opt_param_scheduler"], "rng_state",
"num_floating_point_operations_so_far"}``; it is saved with
``megatron.core.dist_checkpointing.save`` through the default ``torch_dist`` strategy (two
writer threads, so two ``.distcp`` files per rank) wrapped in ``FullyParallelSaveStrategyWrapper``
over the DP group (Megatron-LM's default ``--ckpt-fully-parallel-save``), with
``content_metadata`` = that metadata minus the process group. Only deviation: a CPU build has no
CUDA generator, so ``rng_state[0]["cuda_rng_state"]`` is a 16-byte uint8 tensor laid out like a
Philox state (seed, offset 0) instead of ``torch.cuda.get_rng_state()``.

What the files show (megatron-core 0.16.1, torch 2.13): model keys are layer-stacked
(``decoder.layers.<module>...``, leading dim = layer); the local spec's
``input_layernorm`` / ``pre_mlp_layernorm`` are saved under the TransformerEngine names
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``; every linear layer also
saves an empty ``<module>._extra_state/shard_<l>_<L>`` byte item (``[None]``); the RNG state is
the byte item ``rng_state/shard_<pp>.<tp>_<PP>.<TP>``; ``.metadata`` carries an extra
``all_local_plans`` attribute (pickled ``SavePlan`` / ``WriteItem`` objects).

``logits.pt`` = ``{"input_ids": [batch, seq] int64, "logits": [batch, seq, padded_vocab] fp32,
"true_vocab_size": 1000, "padded_vocab_size": 1024, "logits_optim": ...}``: megatron-core's own
TP forward of the ``ckpt`` model (``logits``) and of the ``ckpt_optim`` model after the step
(``logits_optim``), gathered over TP to the full padded vocabulary (megatron initialises the pad
rows randomly, so trim to ``true_vocab_size`` before comparing with an unpadded model).

Usage::

    python tests/oracles/megatron_core_torch_dist_writer.py OUT_DIR [--dp N] \
        [--optim-sharding fully_reshardable dp_reshardable]
    python tests/oracles/megatron_core_torch_dist_writer.py OUT_DIR --load CKPT [--with-optimizer] \
        [--tp N --dp N]

On megatron-core 0.13.1 (``tests/megatron_core_013.py`` puts it first on ``PYTHONPATH``)
``--optim-sharding`` also takes ``fully_sharded_model_space`` (that release's default) and
``dp_zero_gather_scatter``; ``fully_reshardable`` and ``dp_reshardable`` are 0.14+ forms.

Needs ``megatron-core==0.16.1``, ``einops`` and ``psutil`` on a CPU-only torch, and
``mcore_cpu.py`` next to this script (the model, CPU patches, rank set-up and training step
shared by the megatron-core oracles); takes about 10-20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_cpu import (
    CHECKPOINT_VERSION,
    DATA_SEED,
    FFN_HIDDEN,
    HIDDEN,
    ITERATION,
    KV_CHANNELS,
    MODEL_SEED,
    NUM_HEADS,
    NUM_QUERY_GROUPS,
    TRUE_VOCAB,
    adam_args,
    causal_mask,
    gpt_model,
    lm_batch,
    mean_loss,
    model_args,
    model_parallel,
    padded_vocab_size,
    patch_megatron_for_cpu,
    position_ids,
    randomise_norms,
    reference_input_ids,
    spawn,
    train_step,
    transformer_config,
    wrap_for_training,
)

TP = 2
"""Tensor-parallel size of the run (``--tp`` sets it for ``--load``: Megatron's own load-time
resharding of a checkpoint saved at another TP)."""
DP = 1
"""Data-parallel size (``--dp``): each DP rank trains on the same micro-batch, so the step is
the DP = 1 step, and the distributed optimizer saves its DP ranges of every parameter."""
NUM_LAYERS = 2
BATCH, SEQ = 2, 16
# --optim-sharding type -> the directory its checkpoint goes to
OPTIM_DIRS = {
    "fully_reshardable": "ckpt_optim",
    "dp_reshardable": "ckpt_optim_dp_reshardable",
    # megatron-core <= 0.14's default (0.15 and later refuse to write it), and an older form
    # it still wrote on request: one pickled object per data-parallel group
    "fully_sharded_model_space": "ckpt_optim_model_space",
    "dp_zero_gather_scatter": "ckpt_optim_dp_zero",
}


def num_parameters() -> int:
    """Global parameter count of the unpadded-architecture model (padded vocab included)."""
    attention = (NUM_HEADS + 2 * NUM_QUERY_GROUPS) * KV_CHANNELS * HIDDEN
    attention += HIDDEN * NUM_HEADS * KV_CHANNELS
    mlp = 3 * FFN_HIDDEN * HIDDEN
    per_layer = attention + mlp + 2 * HIDDEN
    return 2 * padded_vocab_size(TP) * HIDDEN + NUM_LAYERS * per_layer + HIDDEN


def megatron_args(with_optimizer: bool, optim_sharding: str | None = None) -> argparse.Namespace:
    """The ``args`` Namespace Megatron-LM stores in ``common.pt`` (names as Megatron-LM)."""
    return argparse.Namespace(
        tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        data_parallel_size=DP,
        world_size=TP * DP,
        **model_args(TP, NUM_LAYERS),
        seq_length=SEQ,
        micro_batch_size=BATCH,
        global_batch_size=BATCH * DP,
        num_experts=None,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        transformer_impl="local",
        use_distributed_optimizer=with_optimizer,
        no_save_optim=not with_optimizer,
        no_save_rng=False,
        use_dist_ckpt=True,
        ckpt_format="torch_dist",
        ckpt_fully_parallel_save=True,
        ckpt_assume_constant_structure=False,
        dist_ckpt_optim_fully_reshardable=optim_sharding == "fully_reshardable",
        distrib_optim_fully_reshardable_mem_efficient=False,
        async_save=False,
        data_parallel_random_init=False,
        **adam_args(),
        iteration=ITERATION,
    )


# --------------------------------------------------------------------------- CPU patches


def patch_fully_reshardable_load() -> None:
    """Process-wide fix for ``--load --with-optimizer`` of a ``fully_reshardable`` checkpoint.

    Applied on top of :func:`mcore_cpu.patch_megatron_for_cpu` (the other writers never load).
    """
    # Loading fully_reshardable optimizer state with torch's Adam (no Apex / TransformerEngine)
    # fails in megatron-core 0.16.1: load_state_dict puts a "step" tensor into every Adam state,
    # then load_parameter_state_from_fully_reshardable hands over {"param", "exp_avg",
    # "exp_avg_sq"} (it skips "step" on purpose) and _set_main_param_and_optimizer_states
    # indexes the source by every destination key, "step" included (KeyError). Copy the keys the
    # source has and leave the "step" load_state_dict already set.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_without_step(
        self: DistributedOptimizer, model_param: torch.nn.Parameter, tensors: dict[str, Any]
    ) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_without_step  # type: ignore[method-assign]


def patch_numpy_product() -> None:
    """megatron-core <= 0.13 checks flattened optimizer shards with ``np.product``, which
    numpy 2 removed; it is ``np.prod`` under its old name (no stored tensor is touched)."""
    import numpy as np

    if not hasattr(np, "product"):
        np.product = np.prod  # type: ignore[attr-defined]


def zero_gradient_step(optimizer: Any) -> None:
    """Adam state for every parameter of a fresh ``DistributedOptimizer`` (megatron-core <= 0.13
    has no ``_init_optimizer_states_with_dummy_values``): one step of the torch optimizer on
    zero gradients, learning rate 0. The load that follows overwrites every value."""
    inner = optimizer.optimizer
    rates = [group["lr"] for group in inner.param_groups]
    for group in inner.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    inner.step()
    for group, rate in zip(inner.param_groups, rates, strict=True):
        group["lr"] = rate
        for param in group["params"]:
            param.grad = None


# --------------------------------------------------------------------------- model and data


def build_model() -> tuple[Any, torch.nn.Module]:
    """megatron-core's TransformerConfig as Megatron-LM derives it from the args, and
    Megatron-LM's GPT model provider (one stage) with it."""
    config = transformer_config(tp=TP, num_layers=NUM_LAYERS, pipeline_dtype=torch.float32)
    # Vocab-parallel logits, as in training (the loss is vocab-parallel cross entropy); the
    # reference forward asks for a runtime gather instead.
    return config, gpt_model(config, parallel_output=True)


def reference_logits(gpt: torch.nn.Module) -> torch.Tensor:
    """megatron-core's own TP forward, logits gathered over TP: ``[b, s, padded_v]`` fp32."""
    was_training = gpt.training
    gpt.eval()
    with torch.no_grad():
        logits = gpt(
            reference_input_ids(BATCH, SEQ),
            position_ids(BATCH, SEQ),
            causal_mask(SEQ),
            runtime_gather_output=True,
        )
    gpt.train(was_training)
    return logits.float().contiguous()


def training_batch() -> dict[str, torch.Tensor]:
    """One fixed, seeded micro-batch (DP = 1, one micro-batch per step)."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    return lm_batch(torch.randint(0, TRUE_VOCAB, (BATCH, SEQ + 1), generator=generator))


# --------------------------------------------------------------------------- saving


def sharded_sd_metadata(optim_sharding: str | None) -> dict[str, Any]:
    """Megatron-LM's ``_build_sharded_state_dict_metadata`` for these args.

    ``optim_sharding`` is ``None`` without an optimizer, else ``"fully_reshardable"``
    (``--dist-ckpt-optim-fully-reshardable``) or ``"dp_reshardable"`` (Megatron-LM's default
    for ``torch_dist`` with ``--use-distributed-optimizer``).
    """
    from megatron.core import parallel_state

    metadata: dict[str, Any] = {}
    if optim_sharding is not None:
        metadata["distrib_optim_sharding_type"] = optim_sharding
    if optim_sharding == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata


def rng_state_object() -> Any:
    """Megatron-LM's ``get_rng_state`` for ``torch_dist``: a ShardedObject over ``(PP, TP)``."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # No CUDA generator on a CPU build: a Philox-shaped stand-in (uint64 seed, uint64 offset).
    cuda_rng_state = torch.tensor([MODEL_SEED, 0], dtype=torch.int64).view(torch.uint8)
    rng_state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": cuda_rng_state,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        [rng_state],  # one entry per DP rank only with --data-parallel-random-init
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
        ),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def save_torch_dist(
    save_dir: Path,
    gpt: torch.nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    num_flops: float = 0.0,
    optim_sharding: str = "fully_reshardable",
) -> None:
    """Megatron-LM's ``save_checkpoint`` for ``--ckpt-format torch_dist`` (sync, global)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    try:
        from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
    except ImportError:  # megatron-core <= 0.13 saved the metadata as it was built

        def _clean_metadata_for_serialization(metadata: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in metadata.items() if k != "dp_cp_group"}

    from megatron.core.rerun_state_machine import get_rerun_state_machine

    with_optimizer = optimizer is not None
    args = megatron_args(with_optimizer, optim_sharding if with_optimizer else None)
    metadata = sharded_sd_metadata(optim_sharding if with_optimizer else None)

    # generate_state_dict
    state_dict: dict[str, Any] = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": ITERATION,
        "model": gpt.sharded_state_dict(metadata=metadata),
    }
    if with_optimizer:
        state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata)
        state_dict["opt_param_scheduler"] = scheduler.state_dict()
    rerun_state = get_rerun_state_machine().state_dict(data_iterator=None, ckpt_format="torch_dist")
    if rerun_state:  # None unless a step needs re-running, as in Megatron-LM
        state_dict["rerun_state_machine"] = rerun_state
    state_dict["rng_state"] = rng_state_object()
    state_dict["num_floating_point_operations_so_far"] = num_flops

    checkpoint_dir = save_dir / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
        False,  # --ckpt-assume-constant-structure
    )
    dist_checkpointing.save(
        state_dict,
        str(checkpoint_dir),
        strategy,
        validate_access_integrity=True,
        content_metadata=_clean_metadata_for_serialization(metadata),
    )
    dist.barrier()
    if dist.get_rank() == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


# --------------------------------------------------------------------------- worker


def worker(rank: int, port: int, out_dir: Path, options: dict[str, Any]) -> None:
    """One TP rank: build, save ``ckpt``, train one step, save ``ckpt_optim`` (or, with
    ``options["load"]``, load a checkpoint into a fresh model instead)."""
    global TP, DP
    TP, DP = options["tp"], options["dp"]
    # dist_checkpointing's fully-parallel save wrapper and FileSystemWriterAsync synchronize.
    patch_megatron_for_cpu(noop_cuda_synchronize=True)
    patch_numpy_product()
    patch_fully_reshardable_load()
    with model_parallel(rank, port, TP * DP, tp=TP, cpu_as_cuda=True):
        if options["load"] is not None:
            load_rank(options["load"], out_dir, options["with_optimizer"])
        else:
            run_rank(out_dir, options["optim_sharding"])


def run_rank(out_dir: Path, optim_sharding: list[str]) -> None:
    """The body of :func:`worker`, inside :class:`CpuAsCudaMode`."""
    # Every rank starts from the same seed (see gpt_model).
    torch.manual_seed(MODEL_SEED)
    config, gpt = build_model()
    randomise_norms(gpt, seed_per_name=True)

    logits = reference_logits(gpt)
    save_torch_dist(out_dir / "ckpt", gpt)

    ddp, optimizer, scheduler = wrap_for_training(config, gpt, global_batch=BATCH * DP)
    losses, grad_norm = train_step(
        ddp, optimizer, scheduler, [training_batch()], global_batch=BATCH * DP
    )
    loss = mean_loss(losses)
    if dist.get_rank() == 0:
        print(f"loss {loss:.4f} grad_norm {grad_norm:.4f}", flush=True)

    logits_optim = reference_logits(gpt)
    # Only a plausible value matters (it is opaque common state): 6 * params * tokens.
    num_flops = 6.0 * num_parameters() * BATCH * SEQ
    for sharding in optim_sharding:
        save_torch_dist(
            out_dir / OPTIM_DIRS[sharding], gpt, optimizer, scheduler, num_flops, sharding
        )

    if dist.get_rank() == 0:
        reference = {
            "input_ids": reference_input_ids(BATCH, SEQ),
            "logits": logits,
            "logits_optim": logits_optim,
            "true_vocab_size": TRUE_VOCAB,
            "padded_vocab_size": padded_vocab_size(TP),
        }
        torch.save(reference, out_dir / "logits.pt")
    dist.barrier()


# --------------------------------------------------------------------------- loading


def load_rank(src: Path, out_dir: Path, with_optimizer: bool) -> None:
    """Megatron-LM's ``load_checkpoint`` for ``torch_dist`` into a freshly built model.

    The fresh model is initialised from another seed, so only what is loaded can reproduce the
    reference logits. Writes ``out_dir/logits.pt`` (``{"input_ids", "logits"}``, as
    :func:`reference_logits`) and re-saves what was loaded with megatron-core's own writer to
    ``out_dir/ckpt`` (optimizer included with ``with_optimizer``), so a test can compare the
    state megatron-core actually holds after loading with the checkpoint it loaded.
    """
    from megatron.core import dist_checkpointing

    torch.manual_seed(MODEL_SEED + 1)
    config, gpt = build_model()
    tracker = (src / "latest_checkpointed_iteration.txt").read_text().strip()
    checkpoint_dir = src / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")

    # Megatron-LM reads the content metadata first: it decides how the optimizer state is laid
    # out (a checkpoint without it is treated as the pre-0.14 fully_sharded_model_space format).
    content = dist_checkpointing.load_content_metadata(str(checkpoint_dir)) or {}
    optimizer = scheduler = None
    if with_optimizer:
        _ddp, optimizer, scheduler = wrap_for_training(config, gpt, global_batch=BATCH * DP)
        # Without Apex / TransformerEngine, DistributedOptimizer.state_dict() needs Adam state
        # to exist already (it reads every param's "step"); a fresh torch Adam has none. Fill it
        # with one zero-gradient step as megatron-core does for fsdp_dtensor; the load below
        # overwrites every value.
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
                inner._init_optimizer_states_with_dummy_values()
            else:  # megatron-core <= 0.13: the same by hand
                zero_gradient_step(inner)
    metadata = sharded_sd_metadata(
        content.get("distrib_optim_sharding_type", "fully_sharded_model_space")
        if with_optimizer
        else None
    )
    sharded: dict[str, Any] = {"model": gpt.sharded_state_dict(metadata=metadata)}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(
            sharded, is_loading=True, metadata=metadata
        )
    # Megatron-LM's default --dist-ckpt-strictness, assume_ok_unexpected, fails the whole load on
    # the first key the model asks for and the checkpoint lacks ("unexpected" in megatron-core's
    # words). return_all loads what matches and reports every mismatch instead, so one run tells
    # a test both whether Megatron-LM's default would load it and whether the values are right.
    state, missing, unexpected = dist_checkpointing.load(
        sharded, str(checkpoint_dir), strict="return_all"
    )
    report = {
        "unexpected_keys": sorted(map(str, unexpected)),
        "missing_keys": sorted(map(str, missing)),
    }
    gpt.load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])

    logits = reference_logits(gpt)
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        reference = {"input_ids": reference_input_ids(BATCH, SEQ), "logits": logits}
        torch.save(reference, out_dir / "logits.pt")
        (out_dir / "load_report.json").write_text(json.dumps(report, indent=1))
    save_torch_dist(
        out_dir / "ckpt",
        gpt,
        optimizer,
        scheduler,
        float(state.get("num_floating_point_operations_so_far", 0.0)),
        content.get("distrib_optim_sharding_type", "fully_reshardable"),
    )


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and spawn one process per tensor-parallel rank."""
    parser = argparse.ArgumentParser(description="Write tiny megatron-core torch_dist checkpoints.")
    parser.add_argument("out_dir", type=Path, help="output directory to (over)write")
    parser.add_argument(
        "--optim-sharding",
        nargs="+",
        choices=sorted(OPTIM_DIRS),
        default=["fully_reshardable"],
        help="DistributedOptimizer sharding types to save after the step, each to its own "
        "directory (fully_reshardable: ckpt_optim, dp_reshardable: ckpt_optim_dp_reshardable)",
    )
    parser.add_argument(
        "--load",
        type=Path,
        default=None,
        help="instead of writing: load this TP=2 torch_dist checkpoint into a fresh GPTModel, "
        "write OUT_DIR/logits.pt and re-save what was loaded to OUT_DIR/ckpt",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=TP,
        help="with --load: the tensor-parallel size to load into (Megatron reshards on load)",
    )
    parser.add_argument(
        "--dp", type=int, default=DP, help="data-parallel size (of the run, or to load into)"
    )
    parser.add_argument(
        "--with-optimizer",
        action="store_true",
        help="with --load: also load the DistributedOptimizer and scheduler state",
    )
    args = parser.parse_args(argv)
    out_dir: Path = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    options = {
        "load": args.load.resolve() if args.load is not None else None,
        "with_optimizer": args.with_optimizer,
        "optim_sharding": args.optim_sharding,
        "tp": args.tp if args.load is not None else TP,
        "dp": args.dp,
    }
    spawn(worker, options["tp"] * options["dp"], out_dir, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
