"""What the megatron-core oracle scripts share: a tiny Llama-style GPTModel run on CPU with gloo.

Used by ``megatron_core_legacy_writer.py``, ``megatron_core_distopt_writer.py`` and
``megatron_core_torch_dist_writer.py``. They are run as scripts (``python tests/oracles/X.py``),
so their own directory is ``sys.path[0]`` and a plain ``import mcore_cpu`` finds this module, in
the rank processes too (forked: see :func:`spawn`). In the tests they run in forks of
``fork_server.py``, which has imported megatron-core once.

Here: the model's fixed sizes and seeds, the CPU patches (:class:`CpuAsCudaMode`,
:func:`patch_megatron_for_cpu`), the rank set-up (:func:`spawn`, :func:`model_parallel`),
megatron-core's ``TransformerConfig`` / ``GPTModel`` for that model, the fixed inputs, and the
DistributedOptimizer training step as Megatron-LM's ``pretrain_gpt.py`` runs it. What a script
writes, and how it differs from the others, stays in the script; where the scripts differ in a
shared step, the difference is a keyword argument each script spells out.

Importing this module silences megatron-core's import-time warnings, so import it before
anything from ``megatron``.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import socket
import warnings
import zlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

# megatron-core warns at import about missing Apex/TransformerEngine and about CUDA-only tuning
# knobs; torch warns that reduce_scatter_tensor / all_gather_into_tensor are deprecated names.
# None of it matters for a CPU oracle.
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

# The model (Llama-style: RMSNorm, SwiGLU, RoPE, GQA, no biases). The number of layers and the
# batch shapes are each script's own.
TRUE_VOCAB = 1000
MAKE_VOCAB_DIVISIBLE_BY = 128
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
INPUT_SEED = 1234
DATA_SEED = 5678

# The one Adam step of the writers that train.
LR = 1e-2
MIN_LR = 1e-3
WEIGHT_DECAY = 0.1
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
CLIP_GRAD = 1.0

ITERATION = 1
CHECKPOINT_VERSION = 3.0


def padded_vocab_size(tp: int) -> int:
    """Megatron's vocab padding: round up to a multiple of 128 * tp."""
    multiple = MAKE_VOCAB_DIVISIBLE_BY * tp
    return int(math.ceil(TRUE_VOCAB / multiple) * multiple)


def model_args(
    tp: int,
    num_layers: int,
    *,
    hidden: int = HIDDEN,
    ffn_hidden: int = FFN_HIDDEN,
    tie_embeddings: bool = False,
) -> dict[str, Any]:
    """The model part of the ``args`` Megatron-LM stores in a checkpoint (names as Megatron-LM).

    In the order every writer stores them (``num_layers`` to ``max_position_embeddings``), so a
    script's ``argparse.Namespace(..., **model_args(...), ...)`` keeps its layout.
    """
    return {
        "num_layers": num_layers,
        "hidden_size": hidden,
        "ffn_hidden_size": ffn_hidden,
        "num_attention_heads": NUM_HEADS,
        "num_query_groups": NUM_QUERY_GROUPS,
        "group_query_attention": True,
        "kv_channels": KV_CHANNELS,
        "padded_vocab_size": padded_vocab_size(tp),
        "vocab_size": TRUE_VOCAB,
        "make_vocab_size_divisible_by": MAKE_VOCAB_DIVISIBLE_BY,
        "swiglu": True,
        "untie_embeddings_and_output_weights": not tie_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": ROTARY_BASE,
        "rotary_percent": 1.0,
        "normalization": "RMSNorm",
        "norm_epsilon": NORM_EPS,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "max_position_embeddings": MAX_POSITIONS,
    }


def adam_args() -> dict[str, Any]:
    """The optimizer part of Megatron-LM's ``args`` for :func:`wrap_for_training`'s Adam."""
    return {
        "optimizer": "adam",
        "lr": LR,
        "min_lr": MIN_LR,
        "weight_decay": WEIGHT_DECAY,
        "adam_beta1": ADAM_BETAS[0],
        "adam_beta2": ADAM_BETAS[1],
        "adam_eps": ADAM_EPS,
        "clip_grad": CLIP_GRAD,
    }


# --------------------------------------------------------------------------- CPU patches


class CpuAsCudaMode(TorchFunctionMode):
    """Run megatron-core's CUDA-only code paths on the CPU.

    * Tensor factories called with ``device="cuda"`` (MixedPrecisionOptimizer's
      ``_dummy_overflow_buf`` / ``_scale_one``, the pipeline schedule's token counter,
      clip_grads' norm buffers, the DistributedOptimizer's all-gather buffers for the
      ``fully_reshardable`` state) raise on a CPU-only build: the device is rewritten to the CPU.
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


def patch_megatron_for_cpu(*, noop_cuda_synchronize: bool) -> None:
    """Process-wide patches for what :class:`CpuAsCudaMode` cannot intercept.

    ``noop_cuda_synchronize`` is for the writers that train or use ``dist_checkpointing``; a
    forward alone never synchronizes. No collective needs patching: torch 2.13's gloo backend
    implements ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (also inside
    ``_coalescing_manager``, sync and async), which is what megatron-core's grad reduce-scatter
    and param all-gather use.
    """
    # RotaryEmbedding, grad buffers (_ParamAndGradBuffer), p2p receive buffers and
    # dist_checkpointing's failure broadcast (save_state_dict_async_finalize) allocate on
    # torch.cuda.current_device(), which raises on a CPU build ("Torch not compiled with CUDA
    # enabled"). Point it at the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]

    if noop_cuda_synchronize:
        # P2PCommunicator calls torch.cuda.synchronize() after batch_isend_irecv (batch_p2p_sync,
        # a guard against an old NCCL race); the fully-parallel save wrapper and
        # FileSystemWriterAsync call it around their device-to-host copies. gloo ops are
        # complete once waited on, and on the CPU every copy is already complete: no-op.
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

    # DotProductAttention runs attention dropout inside get_cuda_rng_tracker().fork(), which
    # needs a CUDA RNG state registered by model_parallel_cuda_manual_seed (CUDA-only). Dropout
    # is 0 and no RNG is drawn, so the fork can be a no-op context.
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    def noop_fork(self: CudaRNGStatesTracker, name: str = "") -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    CudaRNGStatesTracker.fork = noop_fork  # type: ignore[method-assign,assignment]


# --------------------------------------------------------------------------- ranks


def free_port() -> int:
    """Ask the OS for a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


MEGATRON_MODULES = (
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "megatron.core.pipeline_parallel",
)
"""What the ranks use of megatron-core, imported once before they are forked."""


def spawn(worker: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run ``worker(rank, port, *args)`` in ``nprocs`` processes and wait for all of them.

    ``port`` is a free loopback port for their process group (see :func:`model_parallel`). The
    ranks are forked once this process has imported megatron-core: spawned ranks would each
    import torch and megatron-core again (~5 s each, every rank at once on two cores). Nothing
    has run a tensor operation or made a thread here yet, so the fork is safe.
    """
    for name in MEGATRON_MODULES:
        importlib.import_module(name)
    mp.start_processes(
        worker, args=(free_port(), *args), nprocs=nprocs, join=True, start_method="fork"
    )


@contextlib.contextmanager
def model_parallel(
    rank: int,
    port: int,
    world_size: int,
    *,
    tp: int,
    pp: int = 1,
    cpu_as_cuda: bool,
    **parallel: Any,
) -> Iterator[None]:
    """This rank's gloo process group and megatron-core's model-parallel state, torn down on exit.

    DP is what is left of ``world_size`` after ``tp * pp``. With ``cpu_as_cuda`` the body runs
    inside :class:`CpuAsCudaMode` (needed by megatron-core's optimizer, schedules and
    ``dist_checkpointing``; a plain forward does without). Call :func:`patch_megatron_for_cpu`
    before entering. ``parallel`` passes further sizes (``expert_model_parallel_size``, ...) to
    ``initialize_model_parallel``.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    from megatron.core import parallel_state

    try:
        with CpuAsCudaMode() if cpu_as_cuda else contextlib.nullcontext():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **parallel
            )
            yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# --------------------------------------------------------------------------- model


def transformer_config(
    *,
    tp: int,
    num_layers: int,
    pp: int = 1,
    hidden: int = HIDDEN,
    ffn_hidden: int = FFN_HIDDEN,
    dtype: torch.dtype = torch.float32,
    pipeline_dtype: torch.dtype | None = None,
    deallocate_pipeline_outputs: bool = False,
    **overrides: Any,
) -> Any:
    """megatron-core's TransformerConfig for the model, on CPU (``bf16`` iff ``dtype`` is).

    ``pipeline_dtype`` and ``deallocate_pipeline_outputs`` are megatron-core's defaults unless
    given: Megatron-LM derives them from its args (``params_dtype`` and ``True``) for training.
    ``overrides`` replace the Llama-style model fields (a model variant's).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn_hidden,
        num_attention_heads=NUM_HEADS,
        num_query_groups=NUM_QUERY_GROUPS,
        kv_channels=KV_CHANNELS,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=pipeline_dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
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
        deallocate_pipeline_outputs=deallocate_pipeline_outputs,
        # Fused kernels are CUDA-only; use the plain PyTorch paths.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def gpt_model(
    config: Any,
    *,
    parallel_output: bool,
    tie_embeddings: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
    rotary_percent: float = 1.0,
    rotary_base: int = ROTARY_BASE,
    **position: Any,
) -> torch.nn.Module:
    """megatron-core's own GPTModel (local layer spec, no TransformerEngine), Llama-style.

    With ``use_cpu_initialization`` megatron-core initialises each full master weight from the
    global RNG and slices out this rank's TP shard (fc1 with stride 2, so each shard is
    ``[gate_r; up_r]``), so every rank must seed the global RNG alike before this; the full
    model is then the same for every TP size.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=config.qk_layernorm
        ),
        vocab_size=padded_vocab_size(config.tensor_model_parallel_size),
        max_sequence_length=MAX_POSITIONS,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=tie_embeddings,
        rotary_percent=rotary_percent,
        rotary_base=rotary_base,
        # (a variant's RoPE scaling: rope_scaling / rope_scaling_factor, or "yarn")
        **{"position_embedding_type": "rope", **position},
    )


def randomise_norms(model: torch.nn.Module, *, seed_per_name: bool, layer_offset: int = 0) -> None:
    """Set every norm weight to ``1 + 0.1 * randn`` (same on every rank).

    The default all-ones weights would hide a swapped or misplaced norm. With ``seed_per_name``
    each weight draws from its own generator, seeded by its *global* name (decoder layer index
    plus ``layer_offset``, this pipeline stage's first layer), so the values do not depend on
    how the layers are split over stages. Without it one generator is drawn from in
    ``named_parameters()`` order: the legacy writer's values (it has no pipeline stages).
    The noise is drawn in fp32 whatever the parameter's dtype.
    """
    if layer_offset and not seed_per_name:
        raise ValueError("layer_offset needs seed_per_name")
    shared = torch.Generator().manual_seed(NORM_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" not in name:
                continue
            generator = shared
            if seed_per_name:
                parts = name.split(".")
                if parts[:2] == ["decoder", "layers"]:
                    parts[2] = str(int(parts[2]) + layer_offset)
                seed = NORM_SEED + zlib.crc32(".".join(parts).encode())
                generator = torch.Generator().manual_seed(seed)
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(1.0 + 0.1 * noise)


# --------------------------------------------------------------------------- inputs


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's left-to-right mask: ``[1, 1, s, s]`` bool, True = masked out.

    Same convention as Megatron-LM's ``get_ltor_masks_and_position_ids``. Passing it explicitly
    keeps megatron-core from building its default causal mask, which is hard-coded to
    ``device="cuda"``.
    """
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def position_ids(batch: int, seq: int) -> torch.Tensor:
    """``0 .. seq - 1`` for every sequence: ``[batch, seq]``."""
    return torch.arange(seq).unsqueeze(0).expand(batch, seq)


def reference_input_ids(batch: int, seq: int) -> torch.Tensor:
    """The fixed batch the reference logits are computed on."""
    generator = torch.Generator().manual_seed(INPUT_SEED)
    return torch.randint(0, TRUE_VOCAB, (batch, seq), generator=generator)


def lm_batch(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """pretrain_gpt.py's micro-batch from ``[b, s + 1]`` token ids: inputs and next-token labels."""
    batch, seq = tokens.shape[0], tokens.shape[1] - 1
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(batch, seq, dtype=torch.float32),
        "position_ids": position_ids(batch, seq),
        "attention_mask": causal_mask(seq),
    }


# --------------------------------------------------------------------------- training


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


def wrap_for_training(
    config: Any,
    module: torch.nn.Module,
    *,
    global_batch: int,
    bf16: bool = False,
    overlap_grad_reduce: bool = False,
    bucket_size: int | None = None,
    distributed: bool = True,
) -> tuple[Any, Any, Any]:
    """Megatron-LM's setup_model_and_optimizer: DDP, DistributedOptimizer (Adam; with
    ``distributed`` off megatron-core's per-parameter optimizer), scheduler.

    ``bf16`` also reduces grads in fp32 (``--accumulate-allreduce-grads-in-fp32``). The
    scheduler's decay spans ten steps of ``global_batch`` samples.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16,
        overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=bucket_size,
        use_distributed_optimizer=distributed,
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
            bf16=bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=distributed,
        ),
        [ddp],
    )
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
    if overlap_grad_reduce:
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync
    return ddp, optimizer, scheduler


def train_step(
    ddp: Any,
    optimizer: Any,
    scheduler: Any,
    microbatches: list[dict[str, torch.Tensor]],
    *,
    global_batch: int,
) -> tuple[list[dict[str, torch.Tensor]], float]:
    """Megatron-LM's train_step: one step through megatron-core's pipeline schedule (1F1B when
    PP > 1) and ``optimizer.step()``. Returns the last stage's per-micro-batch losses (none on
    the other stages) and the grad norm."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batch, seq = microbatches[0]["tokens"].shape
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[ddp],
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=micro_batch,
        decoder_seq_length=seq,
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful, "optimizer step skipped"
    scheduler.step(increment=global_batch)
    return losses, grad_norm


def mean_loss(losses: list[dict[str, torch.Tensor]]) -> float:
    """The mean per-token loss over micro-batches, from :func:`loss_func`'s reports."""
    return sum(float(x["lm loss"][0] / x["lm loss"][1]) for x in losses) / len(losses)


# --------------------------------------------------------------------------- reporting


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


# --------------------------------------------------------------------------- multi-latent attention


def cpu_multi_latent_attention(spec: Any) -> Any:
    """``spec`` (a layer spec, or a decoder block spec of layer specs) with multi-latent
    attention runnable on the CPU: megatron-core's MLA builds its core attention with
    ``k_channels``/``v_channels``, which only TransformerEngine's ``TEDotProductAttention``
    takes (the local spec's ``DotProductAttention`` does not), so :class:`MlaCoreAttention`
    stands in for it; and its TE-only FP8 check is turned off (``HAVE_TE`` is set when
    megatron-core's TE extension imports without TransformerEngine). No stored tensor changes:
    the core attention has no parameters."""
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention
        if attention.module is mla.MLASelfAttention:
            attention.submodules.core_attention = MlaCoreAttention
    return spec


class MlaCoreAttention(torch.nn.Module):
    """Causal softmax attention over ``[s, b, heads, dim]`` query, key and value whose value
    dimension differs from the query's, scaled by MLA's ``softmax_scale``: the computation
    TransformerEngine's fused attention does, in plain PyTorch (fp32 softmax)."""

    def __init__(
        self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
        softmax_scale: float | None = None, **_: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
        **_: Any,
    ) -> torch.Tensor:  # fmt: skip
        q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        seq = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)
        batch, heads, _, dim = out.shape
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)
