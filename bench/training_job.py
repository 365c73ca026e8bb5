"""The training job of ``bench_training.py`` (run by it under torchrun; not a bench by itself).

Each rank trains a transformers Llama sharded with FSDP2 on CPU and saves its state after some
steps with one saver; rank 0 writes what it measured to ``OUT/<saver>.json``:

* ``blocked``: seconds ``save``/``async_save`` held the training loop, per save;
* ``complete``: seconds from the call until the checkpoint was complete, per save;
* ``step``: seconds per training step (without saves, and while background saves run);
* peak RSS of each rank.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import ckptctl.training


def build(hidden: int, layers: int, vocab: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, vocab: int) -> float:
    start = time.perf_counter()
    x = torch.randint(0, vocab, (1, 32))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    dist.init_process_group("gloo")
    out, saver = sys.argv[1], sys.argv[2]
    hidden, layers, vocab, saves = map(int, sys.argv[3:7])
    model, opt = build(hidden, layers, vocab)
    plain = [step(model, opt, vocab) for _ in range(3)]
    blocked, complete, during = [], [], []
    pending = None
    # torch's async_save needs its own group too: its background collectives on the default
    # group would interleave with FSDP's (observed: a deadlock).
    side = dist.new_group(backend="gloo") if saver == "dcp_async" else None
    for n in range(saves):
        sd = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
        target = f"{out}/{saver}_{n}"
        start = time.perf_counter()
        if saver == "ckptctl_async":
            pending = ckptctl.training.async_save(sd, checkpoint_id=target)
        elif saver == "dcp_async":
            pending = dcp.async_save(sd, checkpoint_id=target, process_group=side)
        elif saver == "dcp_save":
            dcp.save(sd, checkpoint_id=target)
        elif saver == "torch_save":
            os.makedirs(target, exist_ok=True)
            torch.save(sd, f"{target}/rank{dist.get_rank()}.pt")
        blocked.append(time.perf_counter() - start)
        if pending is not None:
            # Train on while the save runs in the background, then wait for it.
            during.append(step(model, opt, vocab))
            pending.result()
        complete.append(time.perf_counter() - start)
        pending = None
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())  # this rank's shards
        body = {
            "blocked": blocked,
            "complete": complete,
            "step": plain,
            "step_during_save": during,
            "rss": rss,
            "params_rank0": params,
        }
        with open(f"{out}/{saver}.json", "w") as f:
            json.dump(body, f)
    ckptctl.training.default_checkpointer().close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
