"""Two ranks load row halves of a tensor one process saved whole to S3 (run under torchrun by
tests/training/test_training_s3.py; the endpoint comes from ``AWS_ENDPOINT_URL``): each rank reads
half of the stored record, so neither read can check it alone. Both ranks load every URL
given but the last, which rank 0 then loads alone (``no_dist``); each rank writes what it
got to ``OUT/rank_N.json``: its load reports' figures, or the errors the loads raised."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptctl
import ckptctl.training

ROWS, COLS = 1 << 10, 1 << 10


def main() -> None:
    dist.init_process_group("gloo")
    out, urls = sys.argv[1], sys.argv[2:]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for url in urls[:-1]:
        template = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)])}
        try:
            report = ckptctl.load(template, checkpoint_id=url)
            results.append(
                {
                    "strategy": report.strategy,
                    "read_for_record_checks": report.read_for_record_checks,
                    "rows": template["w"].to_local().tolist()[0][:4],
                }
            )
        except Exception as err:
            results.append({"error": f"{type(err).__name__}: {err}"})
    # Rank 0 alone (an export), the other rank elsewhere: no collective, so no wait for it.
    alone = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)])}
    if dist.get_rank() == 0:
        report = ckptctl.load(alone, checkpoint_id=urls[-1], no_dist=True)
        results.append({"alone": report.read_for_record_checks})
    with open(f"{out}/rank_{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)
    ckptctl.training.default_checkpointer().close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
