"""Load a DCP directory with torch's own ``dcp.load`` in N CPU processes, resharded on the fly.

Test oracle for ``ckptctl``'s DCP writer: torch itself must be able to read what ckptctl wrote,
into a sharding the writer never saw. It spawns ``--world-size`` processes (gloo backend); every
rank reads the directory's ``.metadata`` with torch's ``FileSystemReader`` and, for every tensor
entry, builds a DTensor of the stored global shape and dtype under a placement of its own
choosing, filled with a sentinel (NaN for floating point, ``-1`` otherwise) so a region
``dcp.load`` never wrote shows up. Then one ``dcp.load`` of all of them, and each rank compares
its local shard with the same slice of the full tensor in ``FULL_PT`` (the parent's
``format_utils.dcp_to_torch_save`` of the same directory), bit for bit.

Placements (chosen to differ from how Megatron-Core / ckptctl cut: TP on dim 0 or 1, PP/layer
stacking on dim 0, so the boxes of the load never coincide with the saved ones):

* world size 2: a 1-D mesh of both ranks; ``Shard(1)`` for 2-D+ tensors whose dim 1 is larger
  than dim 0, else ``Shard(0)``; 0-d tensors ``Replicate()``.
* world size 4: a 2x2 mesh; ``(Shard(0), Shard(-1))`` for 2-D+ tensors (both axes cut, uneven
  where a size is odd), ``(Replicate(), Shard(0))`` for 1-D, ``Replicate()`` for 0-d.

Byte items (pickled objects) are not loaded: only tensors have a shardable layout.

Prints one JSON line on rank 0: ``{"world_size", "tensors", "elements", "problems": [...]}``
(``problems`` gathered from every rank; empty means every local shard matched). Exit code 0
unless a rank raised.

Usage::

    python tests/oracles/dcp_load_reader.py DCP_DIR FULL_PT --world-size 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# DTensor / DCP warn about experimental features and about gloo on CPU.
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


def placements_for(shape: tuple[int, ...], world_size: int) -> tuple[tuple[int, ...], list[Any]]:
    """Mesh shape and placements for a tensor of ``shape`` (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard

    if world_size == 4:
        mesh = (2, 2)
        if len(shape) >= 2:
            return mesh, [Shard(0), Shard(len(shape) - 1)]
        if len(shape) == 1:
            return mesh, [Replicate(), Shard(0)]
        return mesh, [Replicate(), Replicate()]
    mesh = (world_size,)
    if len(shape) >= 2 and shape[1] > shape[0]:
        return mesh, [Shard(1)]
    if len(shape) >= 1:
        return mesh, [Shard(0)]
    return mesh, [Replicate()]


def lookup(full: dict[str, Any], fqn: str, planner_data: dict[str, Any] | None) -> torch.Tensor:
    """The full tensor for ``fqn`` in ``dcp_to_torch_save``'s output: nested along
    ``planner_data``'s key path when the writer recorded one, else stored flat under the FQN."""
    path = tuple(planner_data[fqn]) if planner_data and fqn in planner_data else (fqn,)
    value: Any = full
    for key in path:
        value = value[key]
    return value


def run_rank(rank: int, world_size: int, dcp_dir: Path, full_pt: Path) -> dict[str, Any]:
    """Build sentinel-filled DTensors, ``dcp.load`` them, compare local shards with the truth."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import full as dtensor_full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    metadata = FileSystemReader(str(dcp_dir)).read_metadata()
    meshes: dict[tuple[int, ...], Any] = {}
    state: dict[str, DTensor] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        shape = tuple(entry.size)
        dtype = entry.properties.dtype
        mesh_shape, placements = placements_for(shape, world_size)
        if mesh_shape not in meshes:
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
        sentinel = float("nan") if dtype.is_floating_point else -1
        state[fqn] = dtensor_full(
            shape, sentinel, dtype=dtype, device_mesh=meshes[mesh_shape], placements=placements
        )
    dcp.load(state, checkpoint_id=str(dcp_dir))

    full = torch.load(full_pt, weights_only=False, mmap=True)
    problems: list[str] = []
    elements = 0  # counted per rank: a replicated element counts once per holder
    for fqn, value in state.items():
        local = value.to_local()
        local_shape, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        want = lookup(full, fqn, metadata.planner_data)
        box = tuple(slice(o, o + n) for o, n in zip(offset, local_shape, strict=True))
        want = want[box] if box else want
        elements += local.numel()
        # Compare bit patterns, not values: NaN sentinels (never written) must not match, and a
        # -0.0 / +0.0 or NaN-payload change is still a change.
        if local.shape != want.shape or local.dtype != want.dtype:
            problems.append(
                f"rank {rank} {fqn}: local {tuple(local.shape)} {local.dtype}, "
                f"expected {tuple(want.shape)} {want.dtype}"
            )
        elif not torch.equal(
            local.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
        ):
            problems.append(f"rank {rank} {fqn}: box at {tuple(offset)} differs")
    return {"tensors": len(state), "elements": elements, "problems": problems}


def worker(rank: int, world_size: int, port: int, dcp_dir: Path, full_pt: Path) -> None:
    """One rank: init gloo, :func:`run_rank`, gather every rank's report, print on rank 0."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        report = run_rank(rank, world_size, dcp_dir, full_pt)
        reports: list[Any] = [None] * world_size
        dist.all_gather_object(reports, report)
        if rank == 0:
            summary = {
                "world_size": world_size,
                "tensors": report["tensors"],
                "elements": sum(r["elements"] for r in reports),
                "problems": [p for r in reports for p in r["problems"]],
            }
            print(json.dumps(summary), flush=True)
        # Tearing gloo down while a peer is still inside the last collective aborts the process
        # ("terminate called without an active exception"): leave together.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Even after the barrier, destroying the group (or gloo's threads at interpreter exit)
    # now and then aborts the same way while the peer winds down (seen once in CI, after a
    # correct report): the report is printed and flushed, so leave without destructors.
    sys.stdout.flush()
    os._exit(0)


def free_port() -> int:
    """Ask the OS for a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and spawn ``--world-size`` loading ranks."""
    parser = argparse.ArgumentParser(description="dcp.load a DCP directory under a new sharding.")
    parser.add_argument("dcp_dir", type=Path, help="directory holding .metadata and *.distcp")
    parser.add_argument("full_pt", type=Path, help="dcp_to_torch_save output of the same dir")
    parser.add_argument("--world-size", type=int, choices=(2, 4), default=2)
    args = parser.parse_args(argv)
    mp.start_processes(
        worker,
        args=(args.world_size, free_port(), args.dcp_dir.resolve(), args.full_pt.resolve()),
        nprocs=args.world_size,
        join=True,
        start_method="fork",  # the ranks share the imports made (see fork_server.py)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
