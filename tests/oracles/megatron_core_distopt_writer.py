"""Write a tiny Megatron legacy checkpoint *with distributed-optimizer state*, using megatron-core.

Test oracle for ``ckptctl``: a real third-party writer of ``distrib_optim.pt``. It spawns
``tp * pp * dp`` CPU processes (gloo backend), initialises megatron-core's model-parallel state,
builds megatron-core's own ``GPTModel`` per pipeline stage (local layer spec, Llama-style:
RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings unless ``--tie-embeddings``), wraps it
in megatron-core's ``DistributedDataParallel`` and ``DistributedOptimizer`` (through
``get_megatron_optimizer``), runs ONE training step through megatron-core's pipeline schedule
(``get_forward_backward_func``, 1F1B when ``--pp`` > 1) and ``optimizer.step()``, then saves the
way Megatron-LM's legacy ``save_checkpoint`` (``--ckpt-format torch``) does::

    OUT_DIR/latest_checkpointed_iteration.txt                 "1"
    OUT_DIR/iter_0000001/mp_rank_TT[_PPP]/model_optim_rng.pt  DP rank 0 of each (tp, pp)
    OUT_DIR/iter_0000001/mp_rank_TT[_PPP]/distrib_optim.pt    optimizer.save_parameter_state
    OUT_DIR/truth_tp{T}_pp{P}.pt                              ground truth, see below
    OUT_DIR/meta.json                                         buffer / bucket layout megatron used

``model_optim_rng.pt`` = ``{"args", "checkpoint_version": 3.0, "iteration": 1, "model":
GPTModel.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
"opt_param_scheduler": OptimizerParamScheduler.state_dict()}``.

``truth_tp{T}_pp{P}.pt`` = ``{param_name: {"param", "exp_avg", "exp_avg_sq"}}`` for every
parameter of that (tp, pp) rank (names = ``model`` keys, local layer indices): the fp32 master
weight and Adam moments in the parameter's local (TP-shard) shape, read from the live optimizer
after the step. Each DP rank contributes the slice it owns (megatron's own
``_get_model_param_range_map`` / ``_get_main_param_and_optimizer_states``); the slices are summed
over the DP group and checked to cover every element exactly once. A reader of
``distrib_optim.pt`` must reproduce these tensors exactly.

``meta.json`` holds the run settings and, per ``"tp{T}_pp{P}"``, the effective DDP bucket size
(``None``: one bucket) and per grad buffer its ``dtype_key``, ``numel``, ``numel_unpadded``,
``param_order`` (the order megatron registered the parameters in, = ``named_parameters()``; the
buffer is filled in reverse), ``index_in_buffer_order`` (name -> ``[start, end, bucket_id]`` in
the padded buffer) and ``buckets`` (``offset``, padded ``numel``, ``numel_unpadded``, params).

Usage::

    python tests/oracles/megatron_core_distopt_writer.py OUT_DIR [--tp 2 --pp 2 --dp 2]
        [--bucket-size N] [--overlap-grad-reduce] [--bf16] [--tie-embeddings]
        [--hidden 64 --ffn-hidden 128]

With the default sizes every parameter's numel is a multiple of 64, so the buffer has no
alignment gaps; ``--hidden 48 --ffn-hidden 100`` gives RMSNorm weights (48) and ``linear_fc2``
shards that are not, which exercises megatron's 64-element parameter-start alignment.

``--bucket-size`` implies ``--overlap-grad-reduce`` (without it megatron-core ignores the bucket
size and uses one bucket per buffer). Needs ``megatron-core==0.16.1`` and ``einops`` on a CPU-only
torch; TP2 PP2 DP2 (8 processes) takes well under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import warnings
import zlib
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

# megatron-core warns at import about missing Apex/TransformerEngine and about CUDA-only tuning
# knobs; torch warns that reduce_scatter_tensor / all_gather_into_tensor are deprecated names.
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

TRUE_VOCAB = 1000
MAKE_VOCAB_DIVISIBLE_BY = 128
NUM_LAYERS = 4
HIDDEN = 64
FFN_HIDDEN = 128
NUM_HEADS = 4
NUM_QUERY_GROUPS = 2
KV_CHANNELS = 16
MAX_POSITIONS = 64
ROTARY_BASE = 10000
NORM_EPS = 1e-5
INIT_STD = 0.1
MODEL_SEED = 1234
NORM_SEED = 4321
DATA_SEED = 5678
SEQ = 16
MICRO_BATCH = 2
NUM_MICROBATCHES = 2
LR = 1e-2
MIN_LR = 1e-3
WEIGHT_DECAY = 0.1
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
CLIP_GRAD = 1.0
ITERATION = 1
CHECKPOINT_VERSION = 3.0
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def padded_vocab_size(tp: int) -> int:
    """Megatron's vocab padding: round up to a multiple of 128 * tp."""
    multiple = MAKE_VOCAB_DIVISIBLE_BY * tp
    return int(math.ceil(TRUE_VOCAB / multiple) * multiple)


def megatron_args(opts: argparse.Namespace) -> argparse.Namespace:
    """The ``args`` Namespace Megatron-LM stores in a legacy checkpoint (names as Megatron-LM)."""
    dtype = torch.bfloat16 if opts.bf16 else torch.float32
    return argparse.Namespace(
        tensor_model_parallel_size=opts.tp,
        pipeline_model_parallel_size=opts.pp,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_size=opts.dp,
        world_size=opts.tp * opts.pp * opts.dp,
        expert_model_parallel_size=1,
        num_layers=NUM_LAYERS,
        hidden_size=opts.hidden,
        ffn_hidden_size=opts.ffn_hidden,
        num_attention_heads=NUM_HEADS,
        num_query_groups=NUM_QUERY_GROUPS,
        group_query_attention=True,
        kv_channels=KV_CHANNELS,
        padded_vocab_size=padded_vocab_size(opts.tp),
        vocab_size=TRUE_VOCAB,
        make_vocab_size_divisible_by=MAKE_VOCAB_DIVISIBLE_BY,
        swiglu=True,
        untie_embeddings_and_output_weights=not opts.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=ROTARY_BASE,
        rotary_percent=1.0,
        normalization="RMSNorm",
        norm_epsilon=NORM_EPS,
        add_bias_linear=False,
        add_qkv_bias=False,
        max_position_embeddings=MAX_POSITIONS,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=MICRO_BATCH * NUM_MICROBATCHES * opts.dp,
        num_experts=None,
        params_dtype=dtype,
        bf16=opts.bf16,
        fp16=False,
        accumulate_allreduce_grads_in_fp32=opts.bf16,
        use_distributed_optimizer=True,
        overlap_grad_reduce=opts.overlap_grad_reduce,
        overlap_param_gather=False,
        ddp_bucket_size=opts.bucket_size,
        ckpt_format="torch",
        optimizer="adam",
        lr=LR,
        min_lr=MIN_LR,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1],
        adam_eps=ADAM_EPS,
        clip_grad=CLIP_GRAD,
        iteration=ITERATION,
    )


# --------------------------------------------------------------------------- CPU patches


class CpuAsCudaMode(TorchFunctionMode):
    """Run megatron-core's CUDA-only code paths on the CPU.

    * Tensor factories called with ``device="cuda"`` (MixedPrecisionOptimizer's
      ``_dummy_overflow_buf`` / ``_scale_one``, the pipeline schedule's token counter,
      clip_grads' norm buffers) raise on a CPU-only build: the device is rewritten to the CPU.
    * ``DistributedOptimizer`` picks the fp32 / fp16 / bf16 code path by comparing
      ``param.type()`` with ``'torch.cuda.FloatTensor'`` etc. and raises ``TypeError`` on
      ``'torch.FloatTensor'``: a CPU tensor's ``type()`` reports the CUDA name.
    * ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied embedding to the GPU
      with ``weight.data.cuda()`` before all-reducing it over the embedding group (tied
      embeddings with PP > 1 only): ``Tensor.cuda()`` returns the tensor itself.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if isinstance(device, str | torch.device) and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def patch_megatron_for_cpu() -> None:
    """Process-wide patches for what :class:`CpuAsCudaMode` cannot intercept.

    No collective needs patching: torch 2.13's gloo backend implements ``reduce_scatter_tensor``
    and ``all_gather_into_tensor`` (also inside ``_coalescing_manager``, sync and async), which
    is what megatron-core's grad reduce-scatter and param all-gather use.
    """
    # Grad buffers (_ParamAndGradBuffer), p2p receive buffers and RotaryEmbedding allocate on
    # torch.cuda.current_device(), which raises on a CPU build. Point it at the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]

    # P2PCommunicator calls torch.cuda.synchronize() after batch_isend_irecv (batch_p2p_sync,
    # a guard against an old NCCL race). gloo ops are complete once waited on: no-op.
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

    # DotProductAttention runs attention dropout inside get_cuda_rng_tracker().fork(), which
    # needs a CUDA RNG state registered by model_parallel_cuda_manual_seed (CUDA-only). Dropout
    # is 0 and no RNG is drawn, so the fork can be a no-op context.
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    def noop_fork(self: CudaRNGStatesTracker, name: str = "") -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    CudaRNGStatesTracker.fork = noop_fork  # type: ignore[method-assign,assignment]


# --------------------------------------------------------------------------- model and data


def transformer_config(opts: argparse.Namespace) -> Any:
    """megatron-core TransformerConfig as Megatron-LM derives it from the args."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if opts.bf16 else torch.float32
    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=opts.hidden,
        ffn_hidden_size=opts.ffn_hidden,
        num_attention_heads=NUM_HEADS,
        num_query_groups=NUM_QUERY_GROUPS,
        kv_channels=KV_CHANNELS,
        tensor_model_parallel_size=opts.tp,
        pipeline_model_parallel_size=opts.pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=opts.bf16,
        normalization="RMSNorm",
        layernorm_epsilon=NORM_EPS,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        use_cpu_initialization=True,
        deallocate_pipeline_outputs=True,
        # Fused kernels are CUDA-only; use the plain PyTorch paths.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_stage_model(config: Any, opts: argparse.Namespace) -> torch.nn.Module:
    """Megatron-LM's GPT model provider for this pipeline stage (layers split evenly)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(opts.tp),
        max_sequence_length=MAX_POSITIONS,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=opts.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=ROTARY_BASE,
    )


def randomise_norms(model: torch.nn.Module, layer_offset: int) -> None:
    """Set every norm weight to ``1 + 0.1 * randn``, seeded by its *global* name.

    The default all-ones weights would hide a swapped or misplaced norm state.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" not in name:
                continue
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + layer_offset)
            seed = NORM_SEED + zlib.crc32(".".join(parts).encode())
            generator = torch.Generator().manual_seed(seed)
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(1.0 + 0.1 * noise)


def microbatches(dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's slice of a fixed, seeded global batch, split into micro-batches."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    n_seq = dp * NUM_MICROBATCHES * MICRO_BATCH
    tokens = torch.randint(0, TRUE_VOCAB, (n_seq, SEQ + 1), generator=generator)
    mine = tokens.view(dp, NUM_MICROBATCHES, MICRO_BATCH, SEQ + 1)[dp_rank]
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ)
    return [
        {
            "tokens": mb[:, :-1].contiguous(),
            "labels": mb[:, 1:].contiguous(),
            "loss_mask": torch.ones(MICRO_BATCH, SEQ, dtype=torch.float32),
            "position_ids": positions,
            # Megatron's left-to-right mask, True = masked out; passing it keeps megatron-core
            # from building its default causal mask.
            "attention_mask": mask,
        }
        for mb in mine
    ]


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """pretrain_gpt.py's loss: summed token loss, token count, reporting loss."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[..., Any]]:
    """pretrain_gpt.py's forward step (every stage gets the batch; non-first stages ignore it)."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, partial(loss_func, batch["loss_mask"])


# --------------------------------------------------------------------------- truth and layout


def gather_truth(
    dist_opt: Any, named_params: list[tuple[str, torch.nn.Parameter]], dp_group: Any
) -> dict[str, dict[str, torch.Tensor]]:
    """Full local fp32 master param and Adam moments per parameter, assembled over DP.

    Each DP rank fills the elements it owns (megatron's own param range map) and the pieces are
    summed over the DP group; a coverage count proves every element is owned exactly once.
    """
    truth: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in named_params:
        full = {key: torch.zeros(param.numel(), dtype=torch.float32) for key in STATE_KEYS}
        cover = torch.zeros(param.numel(), dtype=torch.int32)
        if param in dist_opt.model_param_gbuf_map:
            piece = dist_opt._get_model_param_range_map(param)["param"]
            tensors = dist_opt._get_main_param_and_optimizer_states(param)
            for key in STATE_KEYS:
                full[key][piece.start : piece.end] = tensors[key].detach().float().view(-1)
            cover[piece.start : piece.end] += 1
        for tensor in (*full.values(), cover):
            dist.all_reduce(tensor, group=dp_group)
        assert bool((cover == 1).all()), f"{name}: DP shards do not cover it exactly once"
        truth[name] = {key: full[key].view(param.shape).clone() for key in STATE_KEYS}
    return truth


def layout_meta(
    ddp: Any, dist_opt: Any, names: dict[torch.nn.Parameter, str]
) -> list[dict[str, Any]]:
    """The buffers and buckets megatron-core built for this (tp, pp) rank."""
    buffers = []
    for buffer in ddp.buffers:
        index = {
            names[p]: list(buffer.param_index_map[p])
            for p in sorted(buffer.params, key=lambda p: buffer.param_index_map[p][0])
        }
        buffers.append(
            {
                "dtype_key": [str(buffer.param_dtype), str(buffer.grad_dtype)],
                "numel": buffer.numel,
                "numel_unpadded": buffer.numel_unpadded,
                "param_order": [names[p] for p in buffer.params],
                "index_in_buffer_order": index,
                "buckets": [
                    {
                        "offset": bucket.offset,
                        "numel": bucket.grad_data.numel(),
                        "numel_unpadded": bucket.numel_unpadded,
                        "params": [names[p] for p in bucket.params_list],
                    }
                    for bucket in buffer.buckets
                ],
            }
        )
    assert [b.numel_unpadded for b in ddp.buffers] == [b.numel_unpadded for b in dist_opt.buffers]
    return buffers


def describe(value: object, indent: str = "") -> str:
    """Nested structure of a checkpoint object: keys, dtypes, shapes."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, dict):
        lines = [f"{indent}  {k!r}: {describe(v, indent + '  ')}" for k, v in value.items()]
        return "{\n" + "\n".join(lines) + f"\n{indent}}}"
    if isinstance(value, list) and value and isinstance(value[0], dict):
        items = [f"{indent}  [{i}] {describe(v, indent + '  ')}" for i, v in enumerate(value)]
        return "[\n" + "\n".join(items) + f"\n{indent}]"
    if isinstance(value, int | float | str | bool | tuple | None):
        return repr(value)
    return type(value).__name__


# --------------------------------------------------------------------------- worker


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``mp_rank_TT`` (PP == 1) or ``mp_rank_TT_PPP``, as Megatron-LM's get_checkpoint_name."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def worker(rank: int, opts: argparse.Namespace, port: int, out_dir: Path) -> None:
    """One global rank: build, train one step, save its shard and its part of the truth."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    patch_megatron_for_cpu()
    world = opts.tp * opts.pp * opts.dp
    dist.init_process_group("gloo", rank=rank, world_size=world)

    from megatron.core import parallel_state

    try:
        with CpuAsCudaMode():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp
            )
            run_rank(opts, out_dir)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_rank(opts: argparse.Namespace, out_dir: Path) -> None:
    """The body of :func:`worker`, inside :class:`CpuAsCudaMode`."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()

    # With use_cpu_initialization megatron-core initialises each full master weight from the
    # global RNG and slices this rank's TP shard, so every rank starts from the same seed.
    torch.manual_seed(MODEL_SEED)
    config = transformer_config(opts)
    gpt = build_stage_model(config, opts)
    randomise_norms(gpt, layer_offset=pp_rank * (NUM_LAYERS // opts.pp))
    module: torch.nn.Module = Float16Module(config, gpt) if opts.bf16 else gpt

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=opts.bf16,
        overlap_grad_reduce=opts.overlap_grad_reduce,
        use_distributed_optimizer=True,
        bucket_size=opts.bucket_size,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=MIN_LR,
            weight_decay=WEIGHT_DECAY,
            adam_beta1=ADAM_BETAS[0],
            adam_beta2=ADAM_BETAS[1],
            adam_eps=ADAM_EPS,
            clip_grad=CLIP_GRAD,
            bf16=opts.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=True,
        ),
        [ddp],
    )
    global_batch = MICRO_BATCH * NUM_MICROBATCHES * opts.dp
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=LR,
        min_lr=MIN_LR,
        lr_warmup_steps=0,
        lr_decay_steps=10 * global_batch,
        lr_decay_style="cosine",
        start_wd=WEIGHT_DECAY,
        end_wd=WEIGHT_DECAY,
        wd_incr_steps=10 * global_batch,
        wd_incr_style="constant",
    )

    # Megatron-LM's setup_model_and_optimizer / train_step wiring.
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if opts.overlap_grad_reduce:
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches(dp_rank, opts.dp)),
        model=[ddp],
        num_microbatches=NUM_MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        decoder_seq_length=SEQ,
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful, "optimizer step skipped"
    scheduler.step(increment=global_batch)
    if losses:
        loss = sum(float(x["lm loss"][0] / x["lm loss"][1]) for x in losses) / len(losses)
        print(f"[tp{tp_rank} pp{pp_rank} dp{dp_rank}] loss {loss:.4f} grad_norm {grad_norm:.4f}")

    dist_opt = optimizer.chained_optimizers[0]
    names = {param: name for name, param in gpt.named_parameters()}
    state = gpt.state_dict_for_save_checkpoint()
    assert all(name in state for name in names.values())

    rank_dir = out_dir / f"iter_{ITERATION:07d}" / rank_dir_name(tp_rank, pp_rank, opts.pp)
    if dp_rank == 0:
        rank_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # Megatron-LM's save_checkpoint: the DP-gathered parameter state first (collective over DP,
    # written by DP rank 0), then model_optim_rng.pt on DP rank 0.
    optimizer.save_parameter_state(str(rank_dir / "distrib_optim.pt"))
    truth = gather_truth(dist_opt, list(gpt.named_parameters()), dp_group)
    meta = {
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "ddp_bucket_size": ddp.bucket_size,
        "buffers": layout_meta(ddp, dist_opt, names),
    }
    if dp_rank == 0:
        checkpoint = {
            "args": megatron_args(opts),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": ITERATION,
            "model": state,
            "optimizer": optimizer.state_dict(),
            "opt_param_scheduler": scheduler.state_dict(),
        }
        torch.save(checkpoint, rank_dir / "model_optim_rng.pt")
        torch.save(truth, out_dir / f"truth_tp{tp_rank}_pp{pp_rank}.pt")

    metas: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(metas, meta if dp_rank == 0 else None)
    if dist.get_rank() == 0:
        write_meta(out_dir, opts, [m for m in metas if m is not None])
        (out_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        print("distrib_optim.pt:", describe(torch.load(rank_dir / "distrib_optim.pt")))
        saved = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)
        print("model_optim_rng.pt['optimizer']:", describe(saved["optimizer"]))
    dist.barrier()


def write_meta(out_dir: Path, opts: argparse.Namespace, metas: list[dict[str, Any]]) -> None:
    """OUT_DIR/meta.json: run settings plus per-(tp, pp) buffer layout."""
    import megatron.core

    meta = {
        "megatron_core": megatron.core.__version__,
        "torch": torch.__version__,
        "tp": opts.tp,
        "pp": opts.pp,
        "dp": opts.dp,
        "bf16": opts.bf16,
        "tie_embeddings": opts.tie_embeddings,
        "hidden": opts.hidden,
        "ffn_hidden": opts.ffn_hidden,
        "overlap_grad_reduce": opts.overlap_grad_reduce,
        "bucket_size": opts.bucket_size,
        "ranks": {
            f"tp{m['tp_rank']}_pp{m['pp_rank']}": m
            for m in sorted(metas, key=lambda m: (m["tp_rank"], m["pp_rank"]))
        },
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))


def free_port() -> int:
    """Ask the OS for a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and spawn one process per global rank."""
    parser = argparse.ArgumentParser(
        description="Write a tiny megatron-core legacy checkpoint with distributed optimizer."
    )
    parser.add_argument("out_dir", type=Path, help="checkpoint directory to (over)write")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    parser.add_argument(
        "--bucket-size",
        type=int,
        default=None,
        help="DDP bucket size in elements (implies --overlap-grad-reduce)",
    )
    parser.add_argument("--overlap-grad-reduce", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 params, fp32 main params/grads")
    parser.add_argument("--tie-embeddings", action="store_true", help="share embedding/output")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden size ({HIDDEN})")
    parser.add_argument(
        "--ffn-hidden", type=int, default=FFN_HIDDEN, help=f"FFN hidden size ({FFN_HIDDEN})"
    )
    opts = parser.parse_args(argv)
    if opts.tp < 1 or NUM_QUERY_GROUPS % opts.tp:
        parser.error(f"--tp must divide num_query_groups={NUM_QUERY_GROUPS}")
    if opts.pp < 1 or NUM_LAYERS % opts.pp:
        parser.error(f"--pp must divide num_layers={NUM_LAYERS}")
    if opts.dp < 1:
        parser.error("--dp must be >= 1")
    if opts.ffn_hidden % opts.tp:
        parser.error("--tp must divide --ffn-hidden")
    if opts.bucket_size is not None:
        opts.overlap_grad_reduce = True
    out_dir: Path = opts.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    world = opts.tp * opts.pp * opts.dp
    mp.spawn(worker, args=(opts, free_port(), out_dir), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
