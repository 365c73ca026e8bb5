"""One run of ``bench/bench_load.py`` under torchrun: save a sharded state, or load it.

``save OUT ROWS COLS TENSORS``: every rank holds a row shard (``Shard(0)``) of ``TENSORS``
float32 tensors of ``ROWS x COLS`` whose values follow from their position, saved with
``ckptctl.save``. ``load OUT ROWS COLS TENSORS HOW``: every rank loads its row shard of each
with ``ckptctl.load`` or torch's ``dcp.load`` (``HOW``), timed between two barriers; rank 0
writes ``OUT/load.json``: the seconds, each rank's bytes read and ``read_for_record_checks``,
peak RSS. Every rank checks that its values are the saved ones.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import ckptctl
import ckptctl.training


def expected(i: int, rows: int, cols: int, start: int, count: int) -> torch.Tensor:
    """Rows ``[start, start + count)`` of tensor ``i``: values from their positions, so each
    rank builds and checks its own rows only."""
    base = torch.arange(start * cols, (start + count) * cols, dtype=torch.float64)
    return ((base * 1e-7 + i) % 1000).to(torch.float32).reshape(count, cols)


def my_rows(rows: int) -> tuple[int, int]:
    """This rank's first row and row count under ``Shard(0)`` (the last shards may be short)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = -(-rows // world)
    return rank * step, max(0, min(step, rows - rank * step))


def shard_state(mesh, rows: int, cols: int, tensors: int, fill: bool) -> dict[str, DTensor]:
    start, count = my_rows(rows)
    state = {}
    for i in range(tensors):
        local = expected(i, rows, cols, start, count) if fill else torch.zeros(count, cols)
        state[f"layer{i}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], shape=torch.Size((rows, cols)), stride=(cols, 1)
        )
    return state


def main() -> None:
    dist.init_process_group("gloo")
    mode, out = sys.argv[1], sys.argv[2]
    rows, cols, tensors = map(int, sys.argv[3:6])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if mode == "save":
        ckptctl.save(shard_state(mesh, rows, cols, tensors, True), checkpoint_id=f"{out}/ckpt")
    else:
        how = sys.argv[6]
        state = shard_state(mesh, rows, cols, tensors, False)
        dist.barrier()
        start = time.perf_counter()
        figures: dict = {}
        if how == "ckptctl":
            report = ckptctl.load(state, checkpoint_id=f"{out}/ckpt")
            figures = {
                "strategy": report.strategy,
                "bytes_read": report.bytes_read,
                # (absent before 2026-11-27: an A/B against an older commit still runs)
                "read_for_record_checks": getattr(report, "read_for_record_checks", {}),
            }
        else:
            dcp.load(state, checkpoint_id=f"{out}/ckpt")
        dist.barrier()
        seconds = time.perf_counter() - start
        rank, world = dist.get_rank(), dist.get_world_size()
        first, count = my_rows(rows)
        for i in range(tensors):
            local = state[f"layer{i}.weight"].to_local()
            want = expected(i, rows, cols, first, count)
            assert torch.equal(local, want), f"rank {rank}: layer{i} differs"
        figures["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        everyone = [None] * world
        dist.all_gather_object(everyone, figures)
        if rank == 0:
            with open(f"{out}/load.json", "w") as f:
                json.dump({"seconds": seconds, "ranks": everyone}, f)
    ckptctl.training.default_checkpointer().close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
