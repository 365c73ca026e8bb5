"""DeepSpeed ZeRO checkpoints written and read by DeepSpeed itself (test oracle, issue 16).

``write OUT --stage S --dtype fp32|bf16 --dp N``
    N gloo processes on CPU (``DS_ACCELERATOR=cpu``) train a tiny transformers Llama (tied
    embeddings, one frozen weight unless ``--no-frozen``, two parameter groups: weight decay /
    none) two AdamW steps under ZeRO stage S and save it with ``engine.save_checkpoint(OUT)``;
    ``OUT/config.json`` is the model's HF config, as the HF Trainer lays it out (the same model
    is built from ``config.json`` when one is given).

``fp32 CKPT OUT_PT [CKPT OUT_PT ...]``
    DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` (what ``zero_to_fp32.py``
    runs) on each CKPT, saved with ``torch.save`` (several in one process: DeepSpeed's import
    is most of the time of one).

``load-universal CKPT OUT_PT --stage S --dtype D --dp N``
    N processes build the same model and optimizer under ZeRO stage S with
    ``load_universal_checkpoint: true``, load CKPT (a universal checkpoint, through its
    ``latest_universal``) and save what the engine then holds: each trained parameter's fp32
    master and Adam moments (DeepSpeed's ``safe_get_full_*`` accessors), Adam's step per group
    and the groups' settings.
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


def build(
    rank: int,
    world: int,
    port: int,
    stage: int,
    dtype: str,
    lr: float = 1e-3,
    config: Path | None = None,
    frozen: bool = True,
    **extra: object,
) -> object:
    """The DeepSpeed engine of one rank: the tiny Llama, one frozen weight, two AdamW groups."""
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
    model_config = transformers.AutoConfig.from_pretrained(config) if config else llama_config()
    model = transformers.LlamaForCausalLM(model_config)
    if frozen:
        model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in trained if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for _, p in trained if p.dim() <= 1], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if dtype == "bf16":
        ds_config["bf16"] = {"enabled": True}
    ds_config.update(extra)
    built, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return built


def worker(
    rank: int, world: int, port: int, out: Path, stage: int, dtype: str, frozen: bool, fp32: bool
) -> None:
    extra = {"data_types": {"grad_accum_dtype": "fp32"}} if fp32 else {}
    engine = build(rank, world, port, stage, dtype, frozen=frozen, **extra)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(out))
    if rank == 0:
        engine.module.config.save_pretrained(out)
    _finish()


def _finish() -> None:
    """Leave without tearing gloo down: its threads, still joinable at interpreter exit, abort
    the process now and then ("terminate called without an active exception"). Every rank has
    finished writing once all pass the barrier."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def load_universal(
    rank: int, world: int, port: int, ckpt: Path, out: Path, stage: int, dtype: str
) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # Another learning rate than the saved one: loading must restore the groups' settings.
    engine = build(
        rank,
        world,
        port,
        stage,
        dtype,
        5e-4,
        ckpt / "config.json",
        checkpoint={"load_universal": True},
    )
    engine.load_checkpoint(str(ckpt))
    held = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        # Collective under ZeRO 3: every rank asks for every parameter.
        held[name] = {
            "fp32": safe_get_full_fp32_param(param),
            **{s: safe_get_full_optimizer_state(param, s) for s in ("exp_avg", "exp_avg_sq")},
        }
    optimizer = engine.optimizer.optimizer  # the torch AdamW under ZeRO's wrapper
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if rank == 0:
        torch.save({"params": held, "steps": steps, "groups": groups}, out)
    _finish()


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
    write.add_argument("--no-frozen", action="store_true", help="train every parameter")
    write.add_argument(
        "--fp32-grad-accum",
        action="store_true",
        help="bf16 with fp32 gradient accumulation: ZeRO 1 runs under DeepSpeed's BF16_Optimizer",
    )
    fp32 = sub.add_parser("fp32")
    fp32.add_argument("pairs", type=Path, nargs="+", metavar="CKPT OUT_PT")
    load = sub.add_parser("load-universal")
    load.add_argument("ckpt", type=Path)
    load.add_argument("out", type=Path)
    load.add_argument("--stage", type=int, default=2)
    load.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    load.add_argument("--dp", type=int, default=2)
    args = parser.parse_args(argv)
    if args.mode == "write":
        args.out.mkdir(parents=True, exist_ok=True)
        mp.start_processes(
            worker,
            args=(
                args.dp,
                free_port(),
                args.out.resolve(),
                args.stage,
                args.dtype,
                not args.no_frozen,
                args.fp32_grad_accum,
            ),
            nprocs=args.dp,
            start_method="fork",  # the ranks share the imports made (see fork_server.py)
        )
    elif args.mode == "load-universal":
        mp.start_processes(
            load_universal,
            args=(
                args.dp,
                free_port(),
                args.ckpt.resolve(),
                args.out.resolve(),
                args.stage,
                args.dtype,
            ),
            nprocs=args.dp,
            start_method="fork",  # the ranks share the imports made (see fork_server.py)
        )
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        if len(args.pairs) % 2:
            parser.error("fp32 takes pairs: CKPT OUT_PT [CKPT OUT_PT ...]")
        for ckpt, out in zip(args.pairs[::2], args.pairs[1::2], strict=True):
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
            torch.save({k: v.contiguous() for k, v in state.items()}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
