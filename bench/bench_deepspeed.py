"""DeepSpeed ZeRO-2 bf16 checkpoint -> HF safetensors and -> universal checkpoint: ckptctl
against `cp -r` and DeepSpeed's own tools (`zero_to_fp32.py`, `ds_to_universal`), in one run.

Builds, once, a real ZeRO-2 bf16 checkpoint: DeepSpeed 0.19.8 on CPU (gloo, ``--dp``
processes) trains a transformers Llama (``--hidden``, ``--layers``, vocabulary 32000, untied
embeddings) one AdamW step and saves it with ``engine.save_checkpoint``; the defaults give
about 1.6 GB (16-bit module, fp32 masters and two moments). Then times, best of ``--repeat``:
`cp -r` of the tag directory, `zero_to_fp32.py CKPT OUT --safe_serialization`,
`ds_to_universal`, and ckptctl's `consolidate --format hf` and `--format deepspeed-universal`
under ``--memory-budget``. Prints a markdown table (seconds, GB/s of source, ratio to cp, peak
RSS).

    DS_ACCELERATOR=cpu python bench/bench_deepspeed.py [--workdir /tmp/ckptctl-bench-ds]
        [--hidden 1024] [--layers 4] [--dp 2] [--budget 512MiB] [--repeat 2] [--keep]
        [--cold | --cold-source]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchlib import add_cold_options, cache_for, du, measure, print_table

MAKE = r"""
import os, socket, sys
import torch, torch.multiprocessing as mp

def worker(rank, world, port, out, hidden, layers):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed, transformers
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": rest, "weight_decay": 0.0}], lr=1e-4)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                 "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(out)
    if rank == 0:
        config.save_pretrained(out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()

if __name__ == "__main__":
    out, hidden, layers, dp = sys.argv[1], *map(int, sys.argv[2:5])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(dp, port, out, hidden, layers), nprocs=dp)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-ds"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--budget", default="512MiB")
    parser.add_argument("--repeat", type=int, default=2, help="Runs per command (best is kept).")
    parser.add_argument("--keep", action="store_true", help="Keep the generated checkpoint.")
    add_cold_options(parser)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    work = args.workdir
    ckpt = work / "zero2-bf16"
    if not (ckpt / "latest").exists():
        work.mkdir(parents=True, exist_ok=True)
        script = work / "make_zero2.py"
        script.write_text(MAKE)
        shutil.rmtree(ckpt, ignore_errors=True)
        make = [sys.executable, str(script), str(ckpt), str(args.hidden), str(args.layers)]
        subprocess.run([*make, str(args.dp)], check=True, capture_output=True)
    tag = ckpt / (ckpt / "latest").read_text().strip()
    size = du(tag)
    ckptctl = [sys.executable, "-m", "ckptctl"]
    budget = ["--memory-budget", args.budget, "--json"]
    out = {name: work / f"out-{name}" for name in ("cp", "z2f", "ds2u", "hf", "universal")}
    runs = [
        ("`cp -r` of the tag directory", ["cp", "-r", str(tag), str(out["cp"])], out["cp"]),
        (
            "DeepSpeed `zero_to_fp32.py --safe_serialization`",
            [
                sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(out["z2f"]),
                "--safe_serialization",
            ],
            out["z2f"],
        ),
        (
            "DeepSpeed `ds_to_universal`",
            [
                sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                "--input_folder", str(tag), "--output_folder", str(out["ds2u"]),
                "--inject_missing_state", "--num_extract_workers", "2",
            ],
            out["ds2u"],
        ),
        (
            f"ckptctl consolidate --format hf ({args.budget})",
            [*ckptctl, "consolidate", str(ckpt), str(out["hf"]), "--format", "hf", *budget],
            out["hf"],
        ),
        (
            f"ckptctl consolidate --format deepspeed-universal ({args.budget})",
            [
                *ckptctl, "consolidate", str(ckpt), str(out["universal"]),
                "--format", "deepspeed-universal", *budget,
            ],
            out["universal"],
        ),
    ]  # fmt: skip
    cold, cache = cache_for(args, ckpt)
    rows = measure(runs, size, args.repeat, cold=cold)
    # ds_to_universal also writes latest_universal beside its output folder
    (work / "latest_universal").unlink(missing_ok=True)
    print_table(
        rows,
        f"{size / 1e9:.2f} GB DeepSpeed ZeRO-2 bf16 tag directory (DP{args.dp}); {cache}",
        "GB/s and 'vs cp' count the source's bytes read per second; the HF output holds the "
        "fp32 masters, the universal one the masters and both moments.",
    )
    if not args.keep:
        shutil.rmtree(ckpt)


if __name__ == "__main__":
    main()
