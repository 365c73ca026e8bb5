"""A training job for the training-loop API tests, run under torchrun (gloo, CPU): a tiny
transformers Llama sharded with FSDP2 (``fully_shard``) and AdamW.

``python -m torch.distributed.run --standalone --nproc-per-node W worker.py OUT SCENARIO [args]``

* ``train STEPS``: train, ``ckptctl.async_save`` after every step into ``OUT/step_<i>`` while
  training goes on; rank 0 writes the losses, the time each save blocked training, the time it
  took to complete and the time a synchronous ``torch.save`` of the same state takes to
  ``OUT/train_<W>.json``.
* ``resume CKPT STEP STEPS HOW [FULL]``: a fresh model, loaded from ``OUT/CKPT`` (saved after
  step ``STEP``) by ``ckptctl`` (``HOW=ckptctl``, with ``FULL`` as the full checkpoint to fall
  back on) or torch's own ``dcp.load`` (``HOW=torch``), then trained on to ``STEPS``; writes
  ``OUT/resume_<HOW>_<W>.json`` (losses, each rank's load decision and bytes read per file, and
  the full model and optimizer state right after loading, as torch's own ``full_tensor``).
* ``fail``: one save whose shard file rank 1 cannot create (a directory is in its way); every
  rank's future must hold the error, written to ``OUT/fail_<rank>.json``.
* ``kill STEPS KILL_AT``: like ``train``, but rank 1 is killed (SIGKILL) right after handing
  the save of step ``KILL_AT`` to the background.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import ckptctl
import ckptctl.training

HIDDEN = int(os.environ.get("WORKER_HIDDEN", "256"))
BATCH, SEQ, VOCAB = 4, 16, 128


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int) -> torch.Tensor:
    """This rank's rows of the global batch of ``step`` (the same global batch at any W)."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    per = BATCH // dist.get_world_size()
    return rows[dist.get_rank() * per : (dist.get_rank() + 1) * per]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x = batch(step)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def full_state(sd: dict) -> dict:
    """Every tensor whole (torch's own gather), as lists of floats, for the test to compare."""
    out: dict[str, list[float]] = {}

    def walk(prefix: str, v: object) -> None:
        if isinstance(v, dict):
            for k, w in v.items():
                walk(f"{prefix}.{k}", w)
        elif isinstance(v, torch.Tensor):
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[prefix] = t.float().flatten().tolist()

    for part in ("model", "optim"):
        walk(part, sd[part])
    return out


def train(out: str, steps: int, kill_at: int | None = None) -> None:
    model, opt = build()
    losses, blocked, futures, plain = [], [], [], []
    completed: list[float] = [0.0] * steps
    for step in range(steps):
        losses.append(train_step(model, opt, step))
        sd = state(model, opt, step)
        start = time.perf_counter()
        future = ckptctl.async_save(sd, checkpoint_id=f"{out}/step_{step}")
        blocked.append(time.perf_counter() - start)

        def stamp(_: object, step: int = step, start: float = start) -> None:
            """Call to the save's end (written, manifest last), when the future resolves."""
            completed[step] = time.perf_counter() - start

        future.add_done_callback(stamp)
        futures.append(future)
        if kill_at == step and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.perf_counter()
        torch.save(sd, f"{out}/plain_{dist.get_rank()}.pt")
        plain.append(time.perf_counter() - start)
    reports = [f.result() for f in futures]
    if dist.get_rank() == 0:
        body = {
            "losses": losses,
            "blocked": blocked,
            "completed": completed,
            "torch_save": plain,
            "files": [r.files for r in reports],
        }
        with open(f"{out}/train_{dist.get_world_size()}.json", "w") as f:
            json.dump(body, f)


def resume(out: str, name: str, at: int, steps: int, how: str, full: str | None) -> None:
    model, opt = build()
    sd = state(model, opt, -1)
    ckpt = f"{out}/{name}"
    if how == "torch":
        dcp.load(sd, checkpoint_id=ckpt)
        decision = {"strategy": "torch dcp.load"}
    else:
        report = ckptctl.load(sd, checkpoint_id=ckpt, full=full)
        decision = {
            "strategy": report.strategy,
            "reason": report.reason,
            "bytes_by_file": report.bytes_by_file,
            "read_for_record_checks": report.read_for_record_checks,
        }
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded = full_state(state(model, opt, sd["step"]))
    decisions = [None] * dist.get_world_size()
    dist.all_gather_object(decisions, decision)
    losses = [train_step(model, opt, step) for step in range(at + 1, steps)]
    if dist.get_rank() == 0:
        body = {"step": sd["step"], "losses": losses, "decisions": decisions, "state": loaded}
        with open(f"{out}/resume_{how}_{dist.get_world_size()}.json", "w") as f:
            json.dump(body, f)


def fail(out: str) -> None:
    model, opt = build()
    train_step(model, opt, 0)
    if dist.get_rank() == 0:
        os.makedirs(f"{out}/step_0/__1_0.distcp.partial/blocker")
    dist.barrier()
    future = ckptctl.async_save(state(model, opt, 0), checkpoint_id=f"{out}/step_0")
    try:
        future.result()
        error = None
    except Exception as err:
        error = str(err)
    with open(f"{out}/fail_{dist.get_rank()}.json", "w") as f:
        json.dump({"error": error}, f)


def main() -> None:
    dist.init_process_group("gloo")
    out, scenario, *args = sys.argv[1:]
    if scenario == "train":
        train(out, int(args[0]))
    elif scenario == "kill":
        train(out, int(args[0]), kill_at=int(args[1]))
    elif scenario == "fail":
        fail(out)
    elif scenario == "resume":
        resume(out, args[0], int(args[1]), int(args[2]), args[3], (args[4:] or [None])[0])
    ckptctl.training.default_checkpointer().close()
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
