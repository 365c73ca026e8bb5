"""Write a verl FSDP actor checkpoint of an HF model trained with FSDP2, file for file as verl
0.9.1's ``FSDPCheckpointManager.save_checkpoint`` writes it.

verl's own manager cannot run here: importing it imports Ray (and verl's trainer stack), which
this CPU test machine does not install. So this oracle makes the same calls that manager makes,
in the same places (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``): under FSDP2 each
rank ``torch.save``s ``model.state_dict()`` (DTensor shards) to
``model_world_size_W_rank_R.pt``, ``optimizer.state_dict()`` to ``optim_world_size_W_rank_R.pt``
and ``{"lr_scheduler": ..., "rng": ...}`` to ``extra_state_world_size_W_rank_R.pt``; rank 0 saves
the model's config with ``save_pretrained`` in ``huggingface/`` and writes ``fsdp_config.json``
(``{"FSDP_version": 2, "world_size": W}``). The model is built, sharded and trained by torch and
transformers themselves: ``fully_shard`` on each decoder layer and the root, one AdamW step.

Usage::

    python tests/oracles/verl_fsdp_writer.py MODEL OUT_DIR [WORLD [hsdp|lora_only]]

MODEL: ``qwen3`` (a family ckptctl maps), ``gpt_oss`` and ``qwen3_5`` (mapped, with packed
experts and shifted gated norms), ``qwen2_5_vl`` (a VLM, by name) or ``qwen3_lora``
(``qwen3`` wrapped in a PEFT LoRA before sharding, as verl's ``_build_model_optimizer`` does when
``lora_rank > 0``: ``LoraConfig(task_type=CAUSAL_LM, r, lora_alpha, target_modules, bias="none")``,
``target_modules="all-linear"`` (verl's default); the optimizer over every parameter, the frozen
base ones left without state; rank 0 records the adapter's ``r``, ``lora_alpha`` and task in
``lora_train_meta.json``, verl 0.9's ``_save_lora_train_meta``). ``lora_only``: verl's
``checkpoint.save_lora_only``, each rank's model file holding the adapter's parameters alone
(names with ``lora_`` or ``.adapter_``). ``hsdp``: a 2-D mesh (2 replicas x WORLD/2 shards,
verl's hybrid sharding), shards ``(Replicate(), Shard(0))``. Writes
``OUT_DIR/global_step_1/actor/`` and ``OUT_DIR/truth.pt`` (the full weights after the step, by
in-memory name, the batch and the live model's logits; for ``qwen3_lora`` also PEFT's own
adapter state dict, adapter config and the ``merge_and_unload`` weights of the trained model).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEED = 19
VOCAB = 133
LORA = {"task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"}


def build_model(name: str) -> torch.nn.Module:
    import transformers

    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    if name in ("qwen3", "qwen3_lora"):
        config = transformers.Qwen3Config(**text, head_dim=16, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    elif name == "gpt_oss":  # packed experts, as its hub checkpoints store them
        config = transformers.GptOssConfig(
            **{**text, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )
        cls = transformers.GptOssForCausalLM
    elif name == "qwen3_5":  # gated norms held as one plus Megatron's zero-centred weight
        config = transformers.Qwen3_5TextConfig(
            **{**text, "num_hidden_layers": 4},
            head_dim=16,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        cls = transformers.Qwen3_5ForCausalLM
    else:
        vision = dict(
            depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64
        )
        rope = {"type": "mrope", "mrope_section": [2, 2, 4]}
        config = transformers.Qwen2_5_VLConfig(
            text_config={**text, "rope_scaling": rope},
            vision_config=vision,
            vocab_size=VOCAB,
            bos_token_id=1,
            eos_token_id=2,
        )
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    config.architectures = [cls.__name__]
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = cls(config).float()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.1 * torch.randn_like(param))
    if name.endswith("_lora"):
        import peft

        model.enable_input_require_grads()
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA, bias="none"))
    return model


def lora_truth(name: str, full: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict:
    """PEFT's own view of the trained LoRA model: its adapter state dict and config (what
    ``save_pretrained`` writes) and the weights of ``merge_and_unload``, from an unsharded copy
    loaded with the trained state."""
    import peft

    copy = build_model(name)
    copy.load_state_dict(full)
    adapter = peft.get_peft_model_state_dict(copy)
    config = copy.peft_config["default"].to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    with torch.no_grad():
        logits = copy(input_ids=tokens).logits
    merged = copy.merge_and_unload()
    return {
        "adapter": {k: v.clone() for k, v in adapter.items()},
        "adapter_config": config,
        "merged": {k: v.clone() for k, v in merged.state_dict().items()},
        "unsharded_logits": logits,
    }


def gloo(rank: int, port: int, world: int, body: Any, *args: Any) -> None:
    """``body(*args)`` on this rank of a gloo process group of ``world`` CPU processes."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(*args)
    finally:
        dist.destroy_process_group()


def sharded(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2 as verl applies it: each decoder block of the (base) model, then the root."""
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    blocks = set(base._no_split_modules or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(
    rank: int, port: int, name: str, world: int, hsdp: bool, lora_only: bool, out: Path
) -> None:
    gloo(rank, port, world, run_rank, rank, name, world, hsdp, lora_only, out)


def run_rank(rank: int, name: str, world: int, hsdp: bool, lora_only: bool, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    # verl 0.9.1's create_device_mesh (its FSDP engine's utils): its dimension names
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ddp", "fsdp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = build_model(name)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    sharded(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    tokens = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(SEED))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()

    actor = out / "global_step_1" / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = model.state_dict()
    if lora_only:  # verl's save_lora_only: the adapter's parameters alone
        state = {k: v for k, v in state.items() if "lora_" in k or ".adapter_" in k}
    torch.save(state, actor / f"model_world_size_{world}_rank_{rank}.pt")
    torch.save(optimizer.state_dict(), actor / f"optim_world_size_{world}_rank_{rank}.pt")
    extra = {"lr_scheduler": scheduler.state_dict(), "rng": {"cpu": torch.get_rng_state()}}
    torch.save(extra, actor / f"extra_state_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        base.config.save_pretrained(actor / "huggingface")
        with open(actor / "fsdp_config.json", "w") as f:
            json.dump({"FSDP_version": 2, "world_size": world}, f, indent=4)
        if name.endswith("_lora"):  # verl 0.9's _save_lora_train_meta
            meta = {"r": LORA["r"], "lora_alpha": LORA["lora_alpha"], "task_type": "CAUSAL_LM"}
            with open(actor / "lora_train_meta.json", "w", encoding="utf-8") as f:
                json.dump(meta, f, ensure_ascii=False, indent=4)
    full = {
        key: value.full_tensor() if isinstance(value, DTensor) else value
        for key, value in model.state_dict().items()
    }
    optim = full_optimizer_state(model, optimizer)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    if rank == 0:
        truth = {"model": full, "input_ids": tokens, "logits": logits, "optim": optim}
        if name.endswith("_lora"):
            truth.update(lora_truth(name, full, tokens))
        torch.save(truth, out / "truth.pt")
    dist.barrier()


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Adam's state of every trained parameter by name, each DTensor gathered whole."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if state:
            out[name] = {
                k: (v.full_tensor() if isinstance(v, DTensor) else v.clone())
                for k, v in state.items()
            }
    return out


def main() -> int:
    name, out = sys.argv[1], Path(sys.argv[2]).resolve()
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    hsdp = len(sys.argv) > 4 and sys.argv[4] == "hsdp"
    lora_only = len(sys.argv) > 4 and sys.argv[4] == "lora_only"
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    mp.start_processes(
        worker,
        args=(port, name, world, hsdp, lora_only, out),
        nprocs=world,
        join=True,
        start_method="fork",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
