"""Write a tiny Megatron *legacy* checkpoint with megatron-core's own code.

Test oracle for ``ckptctl``: a real third-party writer rather than a checkpoint
we fabricate ourselves. It spawns ``--tp`` CPU processes (gloo backend),
initialises megatron-core's model-parallel state, builds megatron-core's own
``GPTModel`` (local layer spec, no TransformerEngine) configured Llama-style
(RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings, fp32) and writes::

    OUT_DIR/latest_checkpointed_iteration.txt              "1"
    OUT_DIR/iter_0000001/mp_rank_{tp_rank:02d}/model_optim_rng.pt
    OUT_DIR/reference.pt                                   {"input_ids", "logits"}

Each ``model_optim_rng.pt`` is ``{"args", "checkpoint_version": 3.0,
"iteration": 1, "model": model.state_dict_for_save_checkpoint()}``, as
Megatron-LM's legacy ``save_checkpoint`` lays it out (no optimizer / RNG state).
``reference.pt`` holds megatron-core's own tensor-parallel forward on a fixed
batch: logits in ``[batch, seq, vocab]`` order, fp32, trimmed to the true vocab.

Usage::

    python tests/oracles/megatron_core_legacy_writer.py OUT_DIR [--tp 2]

Needs ``megatron-core==0.16.1`` and ``einops`` on a CPU-only torch.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# megatron-core warns at import about missing Apex/TransformerEngine and about
# CUDA-only tuning knobs; none of it matters for a CPU oracle.
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

TRUE_VOCAB = 1000
MAKE_VOCAB_DIVISIBLE_BY = 128
NUM_LAYERS = 2
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
BATCH, SEQ = 2, 17
ITERATION = 1
CHECKPOINT_VERSION = 3.0


def padded_vocab_size(tp: int) -> int:
    """Megatron's vocab padding: round up to a multiple of 128 * tp."""
    multiple = MAKE_VOCAB_DIVISIBLE_BY * tp
    return int(math.ceil(TRUE_VOCAB / multiple) * multiple)


def megatron_args(tp: int) -> argparse.Namespace:
    """The ``args`` Namespace Megatron-LM stores in a legacy checkpoint."""
    return argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN_HIDDEN,
        num_attention_heads=NUM_HEADS,
        num_query_groups=NUM_QUERY_GROUPS,
        group_query_attention=True,
        kv_channels=KV_CHANNELS,
        padded_vocab_size=padded_vocab_size(tp),
        vocab_size=TRUE_VOCAB,
        make_vocab_size_divisible_by=MAKE_VOCAB_DIVISIBLE_BY,
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        rotary_base=ROTARY_BASE,
        rotary_percent=1.0,
        normalization="RMSNorm",
        norm_epsilon=NORM_EPS,
        add_bias_linear=False,
        add_qkv_bias=False,
        max_position_embeddings=MAX_POSITIONS,
        num_experts=None,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        use_distributed_optimizer=False,
        seq_length=MAX_POSITIONS,
    )


def patch_megatron_for_cpu() -> None:
    """The minimal patches megatron-core's forward needs on a CPU-only torch."""
    # RotaryEmbedding.get_emb unconditionally moves inv_freq to
    # torch.cuda.current_device() on the first forward, which raises on a CPU
    # build ("Torch not compiled with CUDA enabled"). Point it at the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]

    # DotProductAttention runs its attention dropout inside
    # get_cuda_rng_tracker().fork(), which requires a CUDA RNG state registered
    # by model_parallel_cuda_manual_seed (CUDA-only). Dropout is 0 here and no
    # RNG is drawn, so the fork can be a no-op context.
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    def noop_fork(self: CudaRNGStatesTracker, name: str = "") -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    CudaRNGStatesTracker.fork = noop_fork  # type: ignore[method-assign,assignment]


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's left-to-right mask: ``[1, 1, s, s]`` bool, True = masked out.

    Same convention as Megatron-LM's ``get_ltor_masks_and_position_ids``.
    Passing it explicitly keeps megatron-core from building its default causal
    mask, which is hard-coded to ``device="cuda"``.
    """
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def reference_input_ids() -> torch.Tensor:
    """The fixed batch the reference logits are computed on."""
    generator = torch.Generator().manual_seed(INPUT_SEED)
    return torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=generator)


def build_model(tp: int) -> torch.nn.Module:
    """Build megatron-core's own GPTModel, Llama-style, on CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN_HIDDEN,
        num_attention_heads=NUM_HEADS,
        num_query_groups=NUM_QUERY_GROUPS,
        kv_channels=KV_CHANNELS,
        tensor_model_parallel_size=tp,
        normalization="RMSNorm",
        layernorm_epsilon=NORM_EPS,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        # Fused kernels are CUDA-only; use the plain PyTorch paths.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(tp),
        max_sequence_length=MAX_POSITIONS,
        pre_process=True,
        post_process=True,
        parallel_output=False,  # gather the vocab-parallel logits on every rank
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=ROTARY_BASE,
    )


def randomise_norms(model: torch.nn.Module) -> None:
    """Set every norm weight to ``1 + 0.1 * randn`` (same on every rank).

    The default all-ones weights would hide a swapped or misplaced norm.
    """
    generator = torch.Generator().manual_seed(NORM_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
                param.copy_(1.0 + 0.1 * noise)


def describe(value: object) -> str:
    """Shape of a tensor, or the type name of anything else."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return type(value).__name__


def worker(rank: int, tp: int, port: int, out_dir: Path) -> None:
    """One TP rank: build, save its shard and (rank 0) the reference logits."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    patch_megatron_for_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=tp)

    from megatron.core import parallel_state

    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()

        # With use_cpu_initialization megatron-core initialises the full master
        # weight from the global RNG and slices out this rank's shard (fc1 with
        # stride 2, so each shard is [gate_r; up_r]), so every rank must start
        # from the same seed. The full model is then the same for every --tp.
        torch.manual_seed(MODEL_SEED)
        model = build_model(tp)
        randomise_norms(model)
        model.eval()

        state = model.state_dict_for_save_checkpoint()
        for name, value in state.items():
            print(f"[rank {tp_rank}] {name}: {describe(value)}", flush=True)

        shard_dir = out_dir / f"iter_{ITERATION:07d}" / f"mp_rank_{tp_rank:02d}"
        shard_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = {
            "args": megatron_args(tp),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": ITERATION,
            "model": state,
        }
        torch.save(checkpoint, shard_dir / "model_optim_rng.pt")

        input_ids = reference_input_ids()
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        with torch.no_grad():
            logits = model(input_ids, position_ids, causal_mask(SEQ))  # [b, s, padded_v]

        if tp_rank == 0:
            reference = {
                "input_ids": input_ids,
                "logits": logits[..., :TRUE_VOCAB].float().contiguous(),
            }
            torch.save(reference, out_dir / "reference.pt")
            (out_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def free_port() -> int:
    """Ask the OS for a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and spawn one process per tensor-parallel rank."""
    parser = argparse.ArgumentParser(description="Write a tiny megatron-core legacy checkpoint.")
    parser.add_argument("out_dir", type=Path, help="checkpoint directory to (over)write")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    args = parser.parse_args(argv)
    if args.tp < 1 or NUM_QUERY_GROUPS % args.tp:
        parser.error(f"--tp must divide num_query_groups={NUM_QUERY_GROUPS}")
    out_dir: Path = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(args.tp, free_port(), out_dir), nprocs=args.tp, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
