"""Write a tiny PyTorch DCP checkpoint from a DTensor model (FSDP2 x TP on a 2x2 mesh).

Test oracle for ``ckptctl``: a real third-party DCP writer (torch's own) rather than a checkpoint
we fabricate ourselves. It spawns 4 CPU processes (gloo backend), builds a small Llama-ish model
(embedding, 2 blocks of RMSNorm + attention with separate q/k/v/o projections + SiLU MLP, final
norm, untied output layer; fp32, seeded), parallelises it on a ``("dp", "tp") = (2, 2)``
DeviceMesh with ``parallelize_module`` (colwise / rowwise tensor parallel over ``"tp"``) and then
``fully_shard`` (FSDP2 over ``"dp"``), runs ONE Adam step on a fixed batch and saves::

    OUT_DIR/dcp/.metadata                   torch.distributed.checkpoint.save of
    OUT_DIR/dcp/__<rank>_0.distcp           {"model": msd, "optim": osd} from get_state_dict
    OUT_DIR/reference.pt                    format_utils.dcp_to_torch_save(OUT_DIR/dcp, ...)
    OUT_DIR/truth.pt                        {"model": full params, "optim": full Adam state,
                                             "input_ids", "logits"} gathered from the live run

DCP flattens the nested dict to dotted FQNs: ``model.<param fqn>``,
``optim.state.<param fqn>.{step,exp_avg,exp_avg_sq}`` (``step`` is a plain 0-d fp32 tensor,
written once) and ``optim.param_groups.<i>.<option>`` (non-tensor values, including the
``params`` list of FQNs, become byte items, each written once by whichever rank the planner's
dedup picks: not necessarily rank 0). ``reference.pt`` is torch's own consolidation of that
directory (the nested dict, full unsharded tensors); ``truth.pt`` is an independent judge:
``DTensor.full_tensor()`` of every parameter and Adam moment after the step, plus the model's
logits on ``input_ids`` after the step (``[batch, seq, vocab]``, fp32).

Layout notes (what makes the boxes interesting):

* TP shards ``wq/wk/wv/w1/output`` on dim 0 (colwise), ``wo/w2`` on dim 1 (rowwise) and the
  embedding on dim 0 (rowwise embedding = vocab split, as in torchtitan); norms are replicated
  over ``"tp"``. FSDP2 then shards every parameter on dim 0 over ``"dp"``. Where TP already
  split dim 0, FSDP2 records the ``"dp"`` placement as ``_StridedShard(0, split_factor=2)``:
  rank ``(dp, tp)`` holds rows ``tp*N/2 + dp*N/4 ...`` of the global tensor, still one
  contiguous box, which is what DCP writes.
* Biases on ``w1`` (colwise: sharded) and ``wo`` (rowwise: replicated over ``"tp"``) so both
  bias rules appear.

CPU / gloo notes: FSDP2 and DTensor work on a ``"cpu"`` DeviceMesh with gloo in torch 2.13; no
reduce-dtype or mesh workaround is needed for fp32 (``MixedPrecisionPolicy`` is left at its
default). The mesh must be built with ``init_device_mesh("cpu", (2, 2), ...)`` and FSDP2 given
``mesh["dp"]`` while TP gets ``mesh["tp"]`` (slices of the same 2-D mesh, so FSDP2 sees the TP
placements and composes them into 2-D DTensors).

Usage::

    python tests/oracles/dcp_dtensor_writer.py OUT_DIR

Takes about 10-20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# torch warns about experimental DTensor / FSDP2 features and deprecated collective names.
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)
# DTensor logs a warning per full_tensor() of a 2-D strided placement (two sequential
# all-gathers); expected here, and it would drown the placement table.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

DP, TP = 2, 2
VOCAB = 320
HIDDEN = 128
FFN_HIDDEN = 256
NUM_HEADS = 4
NUM_LAYERS = 2
NORM_EPS = 1e-5
MODEL_SEED = 1234
INPUT_SEED = 5678
BATCH, SEQ = 4, 16
LR = 1e-2
ADAM_BETAS = (0.9, 0.95)


class RMSNorm(nn.Module):
    """Llama's RMSNorm; weight randomised so a misplaced norm would show in the logits."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * self.weight


class Attention(nn.Module):
    """Causal multi-head attention with separate q/k/v/o projections (no RoPE: not needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wv = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head_dim = HIDDEN // NUM_HEADS
        # Under colwise TP each rank's q/k/v hold NUM_HEADS / TP whole heads, so infer the local
        # head count from the local width instead of using NUM_HEADS.
        q, k, v = (
            w(x).view(b, s, -1, head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SiLU MLP; ``w1`` carries a bias so a colwise (sharded) bias appears in the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, FFN_HIDDEN, bias=True)
        self.w2 = nn.Linear(FFN_HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(HIDDEN)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(HIDDEN)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(nn.Module):
    """torchtitan-style names: ``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(NUM_LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build_model() -> TinyLM:
    """The same full model on every rank (seeded), norms randomised away from all-ones."""
    torch.manual_seed(MODEL_SEED)
    model = TinyLM()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model


def parallelize(model: TinyLM, mesh: Any) -> None:
    """TP over ``mesh["tp"]`` (torchtitan's Llama plan, no sequence parallel), then FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    parallelize_module(
        model,
        tp_mesh,
        {
            # Vocab-parallel embedding: rows split over TP, output all-reduced to Replicate.
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            # Gather the vocab-parallel logits so the loss sees the full vocabulary.
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )
        # Shard(0) is FSDP2's default; spelled out because the box layout depends on it.
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=lambda _param: Shard(0))
    fully_shard(model, mesh=dp_mesh)


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels, identical on every rank (all DP ranks see one batch)."""
    generator = torch.Generator().manual_seed(INPUT_SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def full(value: Any) -> Any:
    """Unshard a DTensor (collective); plain tensors and other values pass through."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def describe_placements(model_sd: dict[str, Any]) -> None:
    """Print each parameter's global shape, placements and local shape (rank 0 only)."""
    for name, value in model_sd.items():
        print(
            f"{name}: global {tuple(value.shape)} placements {value.placements}"
            f" local {tuple(value.to_local().shape)}",
            flush=True,
        )


def worker(rank: int, port: int, out_dir: Path) -> None:
    """One of DP*TP ranks: build, parallelise, one Adam step, DCP save, gather the truth."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=DP * TP)
    try:
        run_rank(rank, out_dir)
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, out_dir: Path) -> None:
    """The body of :func:`worker`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build_model()
    parallelize(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=ADAM_BETAS)

    tokens, labels = fixed_batch()
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    model_sd, optim_sd = get_state_dict(model, optimizer)
    if rank == 0:
        print(f"loss {loss.item():.4f}", flush=True)
        describe_placements(model_sd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out_dir / "dcp"))

    # Independent truth from the live objects, after the step. full_tensor() is a collective,
    # so every rank runs it; rank 0 writes.
    with torch.no_grad():
        after = model(tokens)
    truth = {
        "model": {name: full(value) for name, value in model_sd.items()},
        "optim": {
            name: {key: full(value) for key, value in state.items()}
            for name, state in optim_sd["state"].items()
        },
        "input_ids": tokens,
        "logits": full(after).float(),
    }
    if rank == 0:
        torch.save(truth, out_dir / "truth.pt")
    dist.barrier()


def free_port() -> int:
    """Ask the OS for a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Spawn DP*TP workers, then consolidate their DCP directory with torch's own utility."""
    parser = argparse.ArgumentParser(description="Write a tiny FSDP2 x TP DCP checkpoint.")
    parser.add_argument("out_dir", type=Path, help="output directory to (over)write")
    args = parser.parse_args(argv)
    out_dir: Path = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        worker, args=(free_port(), out_dir), nprocs=DP * TP, join=True, start_method="fork"
    )

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # Torch's own single-process consolidation: the reference a DCP reader must agree with.
    dcp_to_torch_save(out_dir / "dcp", out_dir / "reference.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
