"""verl FSDP actor checkpoint -> another world size (``reshard --dp``) and -> HF safetensors:
ckptctl against ``cp -r`` of the actor directory, in one run.

Builds, once: an FSDP2 run as verl saves it (``model_world_size_W_rank_R.pt`` of DTensor
shards, ``optim_*`` with AdamW's state, ``extra_state_*``, ``huggingface/config.json``) of a
transformers Qwen3 (``--hidden``, ``--layers``, vocabulary 32000, tied embeddings as Qwen3's
small releases) at ``--world`` gloo ranks, one AdamW step on seeded gradients; the defaults
give about 1.8 GB (fp32 weights and two moments). Then times, best of ``--repeat``: ``cp -r``,
``ckptctl reshard --dp N`` and ``ckptctl consolidate`` (HF) under ``--memory-budget``.
verl has no tool for another world size (a run restarts from HF weights, its optimizer state
lost), so ``cp`` is the yardstick.

    python bench/bench_verl.py [--workdir /tmp/ckptctl-bench-verl] [--hidden 1024]
        [--layers 12] [--world 2] [--to 4] [--budget 1GiB] [--repeat 2] [--keep]
        [--cold | --cold-source]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from benchlib import add_cold_options, cache_for, du, measure, print_table

MAKE = r"""
import json, os, socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def worker(rank, world, port, out, hidden, layers):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    config = transformers.Qwen3Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seeded = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=seeded) * 1e-2,
                                   p.device_mesh, p.placements)
    optimizer.step()
    suffix = f"world_size_{world}_rank_{rank}.pt"
    torch.save(model.state_dict(), f"{out}/model_{suffix}")
    torch.save(optimizer.state_dict(), f"{out}/optim_{suffix}")
    torch.save({"lr_scheduler": None, "rng": {"cpu": torch.get_rng_state()}},
               f"{out}/extra_state_{suffix}")
    if rank == 0:
        config.save_pretrained(f"{out}/huggingface")
        with open(f"{out}/fsdp_config.json", "w") as f:
            json.dump({"FSDP_version": 2, "world_size": world}, f, indent=4)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    out, hidden, layers, world = sys.argv[1], *map(int, sys.argv[2:5])
    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, out, hidden, layers), nprocs=world)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-verl"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--world", type=int, default=2, help="Ranks of the saved run.")
    parser.add_argument("--to", type=int, default=4, help="Ranks of the resharded run.")
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--repeat", type=int, default=2, help="Runs per command (best is kept).")
    parser.add_argument("--keep", action="store_true", help="Keep the generated checkpoint.")
    add_cold_options(parser)
    args = parser.parse_args()
    work = args.workdir
    actor = work / f"h{args.hidden}-l{args.layers}-w{args.world}" / "actor"
    if not (actor / "fsdp_config.json").exists():
        shutil.rmtree(actor, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        script = work / "make_verl.py"
        script.write_text(MAKE)
        make = [sys.executable, str(script), str(actor), str(args.hidden), str(args.layers)]
        subprocess.run([*make, str(args.world)], check=True, capture_output=True)
    size = du(actor)
    ckptctl = [sys.executable, "-m", "ckptctl"]
    budget = ["--memory-budget", args.budget, "--json"]
    out = {name: work / f"out-{name}" for name in ("cp", "reshard", "hf")}
    runs = [
        ("`cp -r` of the actor directory", ["cp", "-r", str(actor), str(out["cp"])], out["cp"]),
        (
            f"ckptctl reshard --dp {args.to} ({args.budget})",
            [*ckptctl, "reshard", str(actor), str(out["reshard"]), "--dp", str(args.to), *budget],
            out["reshard"],
        ),
        (
            f"ckptctl consolidate --format hf ({args.budget})",
            [*ckptctl, "consolidate", str(actor), str(out["hf"]), *budget],
            out["hf"],
        ),
    ]
    cold, cache = cache_for(args, actor)
    rows = measure(runs, size, args.repeat, cold=cold)
    print_table(
        rows,
        f"{size / 1e9:.2f} GB verl FSDP2 actor (world {args.world}, fp32 weights and AdamW "
        f"state); {cache}",
        "GB/s and 'vs cp' count the source's bytes read per second; the reshard writes the "
        "weights and both moments again, the HF output the weights only.",
    )
    if not args.keep:
        shutil.rmtree(actor.parent)


if __name__ == "__main__":
    main()
