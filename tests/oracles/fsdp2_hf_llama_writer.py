"""Write a PyTorch DCP checkpoint of an HF ``LlamaForCausalLM`` trained with FSDP2.

Test oracle for ``ckptctl``: the checkpoint people get from FSDP2 training of an HF model
(accelerate / TRL style). It spawns 2 CPU processes (gloo), builds a tiny randomly initialised
Llama (GQA, SwiGLU, untied, fp32, seeded) with transformers, applies ``fully_shard`` to every
decoder layer and the root, runs ONE Adam step on a fixed batch, and saves::

    OUT_DIR/dcp/.metadata, __<rank>_0.distcp   dcp.save({"model": msd, "optim": osd})
    OUT_DIR/dcp/config.json                    the model's HF config (where users keep it)
    OUT_DIR/truth.pt                           {"model": full params after the step,
                                                "input_ids", "logits"} from the live run

DCP keys are ``model.<HF name>`` and ``optim.state.<HF name>.{step,exp_avg,exp_avg_sq}``; FSDP2
shards every parameter on dim 0 over the 2 ranks (uneven where the row count is odd).

Usage::

    python tests/oracles/fsdp2_hf_llama_writer.py OUT_DIR
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

WORLD = 2
SEED = 11
VOCAB = 257  # odd on purpose: FSDP2's dim-0 shards of embedding and lm_head are uneven
BATCH, SEQ = 2, 12


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # norms away from all-ones, so a swapped norm cannot pass unseen
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def fixed_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def worker(rank: int, port: int, out_dir: Path) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        run_rank(rank, out_dir)
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, out_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (WORLD,))
    model = build_model()
    if rank == 0:
        model.config.save_pretrained(out_dir / "dcp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    tokens = fixed_batch()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out_dir / "dcp"))

    full = {
        name: value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in model_sd.items()
    }
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    if rank == 0:
        torch.save({"model": full, "input_ids": tokens, "logits": logits}, out_dir / "truth.pt")
    dist.barrier()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write an FSDP2 DCP checkpoint of an HF Llama.")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    out_dir: Path = args.out_dir.resolve()
    (out_dir / "dcp").mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        worker, args=(free_port(), out_dir), nprocs=WORLD, join=True, start_method="fork"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
