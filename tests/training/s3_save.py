"""Two ranks save to S3 at once (run under torchrun by tests/training/test_training_s3.py; the
endpoint comes from ``AWS_ENDPOINT_URL``): each holds one row shard of a 128 MiB tensor, so each
rank's file goes up in several multipart parts while the other rank's is still being written."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptctl
import ckptctl.training

ROWS, COLS = 8 << 10, 4 << 10  # 128 MiB of float32


def main() -> None:
    dist.init_process_group("gloo")
    url = sys.argv[1]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 3}
    ckptctl.async_save(state, checkpoint_id=url).result()
    again = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]), "step": 0}
    report = ckptctl.load(again, checkpoint_id=url)
    assert report.strategy == "direct", report
    assert torch.equal(again["w"].to_local(), state["w"].to_local()) and again["step"] == 3
    ckptctl.training.default_checkpointer().close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
