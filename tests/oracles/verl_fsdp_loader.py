"""Resume from verl FSDP files as verl 0.9.1's ``FSDPCheckpointManager.load_checkpoint`` does,
at the world size the files were written for: the model built and sharded as
``verl_fsdp_writer`` builds it (FSDP2 on each decoder layer and the root), then each rank
``torch.load``s (``weights_only=False``) its ``model_world_size_W_rank_R.pt`` into
``model.load_state_dict``, its ``optim_*`` into ``optimizer.load_state_dict``, and its
``extra_state_*``'s scheduler and CPU RNG state. Torch itself is the judge of the files: a
DTensor on a mesh of the wrong size, a shard of the wrong rows or an optimizer state torch
cannot take fails here. One more training step then runs on the loaded state.

Usage::

    python tests/oracles/verl_fsdp_loader.py MODEL ACTOR_DIR WORLD OUT.pt

Writes OUT.pt: the loaded weights and Adam state, gathered whole, by name; the scheduler's
state; the loss of the step taken after loading.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from verl_fsdp_writer import SEED, VOCAB, build_model, full_optimizer_state, gloo, sharded


def worker(rank: int, port: int, name: str, actor: Path, world: int, out: Path) -> None:
    gloo(rank, port, world, run_rank, rank, name, actor, world, out)


def run_rank(rank: int, name: str, actor: Path, world: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    model = sharded(build_model(name), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    suffix = f"world_size_{world}_rank_{rank}.pt"
    model.load_state_dict(torch.load(actor / f"model_{suffix}", weights_only=False))
    optimizer.load_state_dict(torch.load(actor / f"optim_{suffix}", weights_only=False))
    extra = torch.load(actor / f"extra_state_{suffix}", weights_only=False)
    scheduler.load_state_dict(extra["lr_scheduler"])
    torch.set_rng_state(extra["rng"]["cpu"])
    full = {
        key: value.full_tensor() if isinstance(value, DTensor) else value
        for key, value in model.state_dict().items()
    }
    optim = full_optimizer_state(model, optimizer)
    tokens = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(SEED + 1))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    if rank == 0:
        state = {"model": full, "optim": optim, "scheduler": scheduler.state_dict()}
        torch.save({**state, "loss": float(loss)}, out)
    dist.barrier()


def main() -> int:
    name, actor = sys.argv[1], Path(sys.argv[2]).resolve()
    world, out = int(sys.argv[3]), Path(sys.argv[4]).resolve()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    mp.start_processes(
        worker, args=(port, name, actor, world, out), nprocs=world, join=True, start_method="fork"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
