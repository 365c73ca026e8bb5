"""Resume from verl FSDP files as verl 0.9.1's ``FSDPCheckpointManager.load_checkpoint`` does,
at the world size the files were written for: the model built and sharded as
``verl_fsdp_writer`` builds it (FSDP2 on each decoder layer and the root), then each rank
``torch.load``s (``weights_only=False``) its ``model_world_size_W_rank_R.pt`` into
``model.load_state_dict``, its ``optim_*`` into ``optimizer.load_state_dict``, and its
``extra_state_*``'s scheduler and CPU RNG state. Torch itself is the judge of the files: a
DTensor on a mesh of the wrong size, a shard of the wrong rows or an optimizer state torch
cannot take fails here. One more training step then runs on the loaded state.

Usage::

    python tests/oracles/verl_fsdp_loader.py MODEL ACTOR_DIR WORLD OUT.pt [SHARDS]

SHARDS: HSDP, a 2-D mesh of WORLD/SHARDS replicas of SHARDS-rank shard groups; without it, one
flat mesh. Both named as verl 0.9.1's ``create_device_mesh`` names them (``ddp``, ``fsdp``).

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
from verl_fsdp_writer import SEED, VOCAB, build_model, gloo, sharded


def worker(
    rank: int, port: int, name: str, actor: Path, world: int, out: Path, shards: int
) -> None:
    gloo(rank, port, world, run_rank, rank, name, actor, world, out, shards)


def run_rank(rank: int, name: str, actor: Path, world: int, out: Path, shards: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    if shards:  # the names as verl 0.9.1's create_device_mesh gives them
        names = ("ddp", "fsdp")
        mesh = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=names)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
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
    optim = loaded_optimizer_state(model, optimizer)
    tokens = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(SEED + 1))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    if rank == 0:
        state = {"model": full, "optim": optim, "scheduler": scheduler.state_dict()}
        torch.save({**state, "loss": float(loss)}, out)
    dist.barrier()


def loaded_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Adam's state as loaded, each DTensor gathered whole. The loaded state keeps the mesh
    pickled in the file, whose process group names are the saving run's (torch warns on
    unpickling them here); torch judges that mesh equal to its parameter's (``DeviceMesh``'s
    ``__eq__``: ranks, layout, dimension names) with this rank's coordinates, and its local
    shard is gathered over the parameter's own mesh, whose groups this run made."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if not state:
            continue
        out[name] = {}
        for kind, value in state.items():
            if isinstance(value, DTensor):
                mesh = param.device_mesh
                assert value.device_mesh == mesh, (name, kind, value.device_mesh, mesh)
                assert value.device_mesh.get_coordinate() == mesh.get_coordinate(), name
                assert value.placements == param.placements, (name, kind)
                local, placements = value.to_local(), value.placements
                on = DTensor.from_local(
                    local, mesh, placements, shape=value.shape, stride=value.stride()
                )
                value = on.full_tensor()
            out[name][kind] = value.clone()
    return out


def main() -> int:
    name, actor = sys.argv[1], Path(sys.argv[2]).resolve()
    world, out = int(sys.argv[3]), Path(sys.argv[4]).resolve()
    shards = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    mp.start_processes(
        worker,
        args=(port, name, actor, world, out, shards),
        nprocs=world,
        join=True,
        start_method="fork",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
