"""DTensor placements for the training-loop API tests, run under torchrun (gloo, CPU).

``python -m torch.distributed.run --standalone --nproc-per-node 4 placements.py OUT``

Saves tensors under several placements on a 2x2 mesh (row and column shards, replicated on one
mesh dimension, unevenly split, FSDP2 over TP's strided shards, plain replicated tensors,
values) with ``ckptctl.save``, then
loads them into templates of other placements, once with ``ckptctl.load`` and once with torch's
own ``dcp.load``; each rank checks its local shards against the slice torch's
``distribute_tensor`` cuts from the full tensor and writes what it found to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import ckptctl
import ckptctl.training

FULL = {
    "rows": (torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6), torch.float32),
    "cols": (torch.arange(4 * 10, dtype=torch.float32).reshape(4, 10), torch.bfloat16),
    "uneven": (torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3), torch.float16),
    "cube": (torch.arange(4 * 4 * 2, dtype=torch.float32).reshape(4, 4, 2), torch.float32),
    "fsdp_tp": (torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3), torch.float32),
    "to_fsdp_tp": (torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5), torch.bfloat16),
}
# FSDP2 over tensor parallelism (a column-parallel weight): rows cut over TP (mesh dim 1),
# each TP shard cut again over FSDP (mesh dim 0), as fully_shard leaves a TP-sharded parameter.
FSDP_TP = (_StridedShard(0, split_factor=2), Shard(0))
SAVED = {
    "rows": (Shard(0), Shard(1)),
    "cols": (Replicate(), Shard(1)),
    "uneven": (Shard(0), Replicate()),
    "cube": (Shard(2), Shard(0)),
    "fsdp_tp": FSDP_TP,
    "to_fsdp_tp": (Shard(1), Replicate()),
}
# transformers' packed tensor parallelism (``packed_colwise``: gate and up strips of one weight)
# on the TP dimension alone: each rank holds two strips of the rows, not one box of them.
PACKED = (Replicate(), _StridedShard(0, split_factor=2))
LOADED = {
    "rows": (Shard(1), Replicate()),
    "cols": (Shard(0), Shard(0)),
    "uneven": (Shard(1), Shard(0)),
    "cube": (Replicate(), Shard(1)),
    "fsdp_tp": (Shard(0), Replicate()),
    "to_fsdp_tp": FSDP_TP,
}


def state(mesh, placements: dict, empty: bool) -> dict:
    sd = {}
    for name, (full, dtype) in FULL.items():
        t = distribute_tensor(full.to(dtype), mesh, placements[name])
        sd[name] = torch.zeros_like(t) if empty else t
    sd["plain"] = torch.zeros(3) if empty else torch.tensor([1.0, 2.0, 3.0])
    sd["meta"] = {"epoch": 0 if empty else 7, "name": "" if empty else "run"}
    return sd


def check(sd: dict, mesh) -> list[str]:
    bad = []
    for name, (full, dtype) in FULL.items():
        want = distribute_tensor(full.to(dtype), mesh, LOADED[name]).to_local()
        got = sd[name].to_local()
        if got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(name)
    if not torch.equal(sd["plain"], torch.tensor([1.0, 2.0, 3.0])):
        bad.append("plain")
    if sd["meta"] != {"epoch": 7, "name": "run"}:
        bad.append("meta")
    return bad


def packed_refused(mesh, out: str) -> list[list[object]]:
    """``ckptctl.save`` and ``ckptctl.load`` of a packed strided shard: refused by name, each
    (torch's offsets would make its two strips one box of the wrong rows)."""
    from ckptctl.errors import UsageError

    packed = {"gate_up": distribute_tensor(FULL["fsdp_tp"][0], mesh, PACKED)}
    found: list[list[object]] = []
    for what in ("save", "load"):
        try:
            if what == "save":
                ckptctl.save(packed, checkpoint_id=f"{out}/packed")
            else:
                ckptctl.load(packed, checkpoint_id=f"{out}/ckpt")
        except UsageError as err:
            found.append([what, "gate_up" in str(err) and "strips" in str(err)])
    return found


def main() -> None:
    dist.init_process_group("gloo")
    out = sys.argv[1]
    mesh = init_device_mesh("cpu", (2, 2))
    ckptctl.save(state(mesh, SAVED, empty=False), checkpoint_id=f"{out}/ckpt")
    ours = state(mesh, LOADED, empty=True)
    report = ckptctl.load(ours, checkpoint_id=f"{out}/ckpt")
    torchs = state(mesh, LOADED, empty=True)
    dcp.load(torchs, checkpoint_id=f"{out}/ckpt")
    body = {
        "packed_refused": packed_refused(mesh, out),
        "strategy": report.strategy,
        "ours_wrong": check(ours, mesh),
        "torchs_wrong": check(torchs, mesh),
        "bytes_read": report.bytes_read,
    }
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(body, f)
    ckptctl.training.default_checkpointer().close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
