"""Write a PyTorch DCP checkpoint of an HF model that ckptctl has no family table for (or
holds in transformers 5's in-memory naming), trained with FSDP2.

Test oracle for ``ckptctl``: 2 CPU processes (gloo; 4 with ``--tp 2``: each decoder layer's
attention and dense MLP tensor-parallel first, as torchtitan does) build a tiny seeded
transformers model, ``fully_shard`` every block transformers marks unsplittable
(``_no_split_modules``) and the root, run ONE Adam step on a fixed batch of text, and save::

    OUT_DIR/dcp/.metadata, __<rank>_0.distcp   dcp.save({"model": msd, "optim": osd})
    OUT_DIR/dcp/config.json, generation_config.json   as save_pretrained writes them
    OUT_DIR/truth.pt   {"model": full state dict after the step (in-memory names),
                        "moments": Adam's state by parameter name, full tensors,
                        "input_ids", "logits"} from the live run

Models: ``qwen2_5_vl`` (a VLM: vision tower, ``model.language_model.*`` in memory, tied
embeddings), ``qwen3_moe`` (transformers 5 packs each layer's experts into
``experts.gate_up_proj`` / ``experts.down_proj``) and ``gemma3`` (Gemma 3 text: four norms
per layer, local and global layers; ``gemma3_vl``: inside its vision-language model, a SigLIP
tower and projector beside it, tied), ``qwen3_5`` (Qwen3.5 text: gated delta net layers,
transformers' torch kernels) and ``gpt_oss`` (GPT-OSS: packed experts held in memory as its
hub checkpoints store them, transposed with gate and up interleaved; sinks, a 4-token window).
No CPU shims: transformers' eager attention runs as it is. Under ``--tp``, Qwen3's per-head
q/k norms see only each rank's heads: their gradients are summed over the TP group before the
step, as a trainer's own TP plan does.

Usage::

    python tests/oracles/fsdp2_hf_any_writer.py MODEL OUT_DIR [--tp 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEED = 13
DP = 2
VOCAB = 301  # odd: FSDP2's dim-0 shards of the embedding are uneven
BATCH, SEQ = 2, 10
GEMMA3_TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    sliding_window=4,
    sliding_window_pattern=2,
    query_pre_attn_scalar=24,
)
"""Gemma 3's text decoder, alone (``gemma3``) and inside its vision-language model."""


def build_model(name: str) -> torch.nn.Module:
    import transformers

    if name == "qwen2_5_vl":
        text = dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        )
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        )
        config = transformers.Qwen2_5_VLConfig(
            text_config=text,
            vision_config=vision,
            vocab_size=VOCAB,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    elif name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=VOCAB,
            num_experts=4,
            num_experts_per_tok=2,
            bos_token_id=1,
            eos_token_id=2,
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif name == "gemma3":
        config = transformers.Gemma3TextConfig(
            **GEMMA3_TEXT,
            bos_token_id=1,
            eos_token_id=2,
        )
        cls = transformers.Gemma3ForCausalLM
    elif name == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=VOCAB,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            bos_token_id=1,
            eos_token_id=2,
        )
        cls = transformers.Qwen3_5ForCausalLM
    elif name == "gemma3_vl":
        text = GEMMA3_TEXT
        vision = dict(
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
        )
        config = transformers.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        cls = transformers.Gemma3ForConditionalGeneration
    elif name == "gpt_oss":
        config = transformers.GptOssConfig(
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=VOCAB,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            bos_token_id=1,
            eos_token_id=2,
        )
        cls = transformers.GptOssForCausalLM
    else:
        raise SystemExit(f"unknown model {name!r}")
    config.architectures = [cls.__name__]  # as a hub model's config.json names it
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = cls(config).float()
    with torch.no_grad():  # norms away from all-ones, so a swapped norm cannot pass unseen
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def fixed_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)


def worker(rank: int, port: int, name: str, tp: int, out_dir: Path) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=DP * tp)
    try:
        run_rank(rank, name, tp, out_dir)
    finally:
        dist.destroy_process_group()


def tensor_parallel(model: torch.nn.Module, mesh: object) -> None:
    """Megatron-style TP of every decoder layer's attention and dense MLP, as torchtitan and
    transformers' own TP plans cut them: q/k/v and gate/up by output rows, o/down by input
    columns (experts and the vision tower stay whole)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(),
        **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        "mlp.down_proj": RowwiseParallel(),
    }
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            names = {n for n, _ in module.named_modules()}
            parallelize_module(module, mesh, {k: v for k, v in plan.items() if k in names})


def sum_head_norm_grads(model: torch.nn.Module, tp_mesh: object) -> None:
    """Per-head q/k norms (Qwen3) act on each TP rank's own heads, so each rank holds part of
    their gradient: summed over the TP group, as a trainer's TP plan does (torchtitan keeps
    them replicated DTensors whose partial gradients it reduces)."""
    group = tp_mesh.get_group()  # type: ignore[attr-defined]
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")) and param.grad is not None:
            local = getattr(param.grad, "_local_tensor", param.grad)
            dist.all_reduce(local, group=group)


def run_rank(rank: int, name: str, tp: int, out_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (DP, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(name)
    if rank == 0:
        model.config.save_pretrained(out_dir / "dcp")
        if model.generation_config is not None:
            model.generation_config.save_pretrained(out_dir / "dcp")
    if tp > 1:  # FSDP2 over TP: the TP-cut weights become _StridedShard DTensors
        tensor_parallel(model, mesh["tp"])
    blocks = set(model._no_split_modules or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    tokens = fixed_batch()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if tp > 1:
        sum_head_norm_grads(model, mesh["tp"])
    optimizer.step()
    optimizer.zero_grad()

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out_dir / "dcp"))

    full = {
        key: value.full_tensor() if isinstance(value, DTensor) else value
        for key, value in model_sd.items()
    }
    moments = {
        name: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
        for name, state in optim_sd["state"].items()
    }
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    if rank == 0:
        truth = {"model": full, "moments": moments, "input_ids": tokens, "logits": logits}
        torch.save(truth, out_dir / "truth.pt")
    dist.barrier()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write an FSDP2 DCP checkpoint of an HF model.")
    models = ("qwen2_5_vl", "qwen3_moe", "gemma3", "gemma3_vl", "qwen3_5", "gpt_oss")
    parser.add_argument("model", choices=models)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism (ranks: 2 x TP)")
    args = parser.parse_args(argv)
    out_dir: Path = args.out_dir.resolve()
    (out_dir / "dcp").mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        worker,
        args=(free_port(), args.model, args.tp, out_dir),
        nprocs=DP * args.tp,
        join=True,
        start_method="fork",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
