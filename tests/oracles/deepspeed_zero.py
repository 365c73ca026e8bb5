"""DeepSpeed ZeRO checkpoints written and read by DeepSpeed itself (test oracle, issue 16).

``write OUT --stage S --dtype fp32|bf16 --dp N``
    N gloo processes on CPU (``DS_ACCELERATOR=cpu``) train a tiny transformers Llama (tied
    embeddings, one frozen weight, two parameter groups: weight decay / none) two AdamW steps
    under ZeRO stage S and save it with ``engine.save_checkpoint(OUT)``; ``OUT/config.json`` is
    the model's HF config, as the HF Trainer lays it out.

``fp32 CKPT OUT_PT``
    DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` (what ``zero_to_fp32.py``
    runs) on CKPT, saved with ``torch.save``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

VOCAB, SEQ, MICRO_BATCH, STEPS = 128, 12, 2, 2


def llama_config() -> object:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )


def worker(rank: int, world: int, port: int, out: Path, stage: int, dtype: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import deepspeed
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = llama_config()
    model = transformers.LlamaForCausalLM(config)
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)  # a frozen parameter
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in trained if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for _, p in trained if p.dim() <= 1], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if dtype == "bf16":
        ds_config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(out))
    if rank == 0:
        config.save_pretrained(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    write = sub.add_parser("write")
    write.add_argument("out", type=Path)
    write.add_argument("--stage", type=int, default=2)
    write.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    write.add_argument("--dp", type=int, default=2)
    fp32 = sub.add_parser("fp32")
    fp32.add_argument("ckpt", type=Path)
    fp32.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.mode == "write":
        args.out.mkdir(parents=True, exist_ok=True)
        mp.spawn(
            worker,
            args=(args.dp, free_port(), args.out.resolve(), args.stage, args.dtype),
            nprocs=args.dp,
        )
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(args.ckpt))
        torch.save({k: v.contiguous() for k, v in state.items()}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
