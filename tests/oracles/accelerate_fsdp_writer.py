"""Write accelerate's ``save_state`` of an HF model trained under FSDP2.

Test oracle for ``ckptctl``: accelerate's own ``Accelerator(fsdp_plugin=...)``, ``prepare``,
``backward`` and ``save_state`` on a tiny seeded Qwen3 (transformers), one AdamW step on a
fixed batch, 2 gloo processes (forked here with torchrun's environment variables)::

    python accelerate_fsdp_writer.py OUT_DIR [SHARDED_STATE_DICT|FULL_STATE_DICT] [lora|gpt_oss]

    OUT_DIR/state/                 what save_state writes (pytorch_model_fsdp_0/ and optimizer_0/
                                   DCP directories, or pytorch_model_fsdp_0.bin; random states)
    OUT_DIR/config.json            the model's config (save_state keeps none)
    OUT_DIR/truth.pt               {"model": full weights after the step, "input_ids", "logits"}

``gpt_oss``: a tiny GPT-OSS instead (``fsdp2_hf_any_writer``'s: packed experts with gates and
ups interleaved, attention sinks, biases), each ``GptOssDecoderLayer`` wrapped.

``lora``: the model is wrapped in a PEFT LoRA (``get_peft_model``, r 4, alpha 8, all linear
layers) before ``prepare``, as TRL / the HF Trainer do for a LoRA fine-tune under FSDP;
``truth.pt`` also holds PEFT's own adapter state dict and config and ``merge_and_unload``'s
weights, from an unsharded copy loaded with the trained state.

CPU shim (no effect on what is stored): accelerate takes its FSDP path only on accelerators
(on CPU it picks ``MULTI_CPU``, plain DDP), so the oracle sets the state's distributed type to
``FSDP`` before ``prepare`` and again before ``save_state`` (accelerate resets it to
``MULTI_CPU`` in between).
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
SEED = 17
VOCAB = 131
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def build_model(name: str = "qwen3") -> torch.nn.Module:
    import transformers

    if name == "gpt_oss":
        from fsdp2_hf_any_writer import build_model as build_any

        return build_any("gpt_oss")

    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = transformers.Qwen3ForCausalLM(config).float()
    with torch.no_grad():  # norms away from all-ones, so a swapped norm cannot pass unseen
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def wrapped(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(**LORA))


def lora_truth(full: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict:
    """PEFT's own view of the trained model, from an unsharded copy."""
    import peft

    copy = wrapped(build_model())
    copy.load_state_dict(full)
    adapter = peft.get_peft_model_state_dict(copy)
    with torch.no_grad():
        logits = copy(input_ids=tokens).logits
    merged = copy.merge_and_unload()
    return {
        "adapter": {k: v.clone() for k, v in adapter.items()},
        "merged": {k: v.clone() for k, v in merged.state_dict().items()},
        "unsharded_logits": logits,
    }


def worker(rank: int, port: int, out: Path, state_dict_type: str, lora: bool, name: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
    )
    run_rank(out, state_dict_type, lora, name)


def run_rank(out: Path, state_dict_type: str, lora: bool, name: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        state_dict_type=state_dict_type,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[
            "GptOssDecoderLayer" if name == "gpt_oss" else "Qwen3DecoderLayer"
        ],
    )
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP  # the CPU shim (see above)
    accelerator.state.fsdp_plugin = plugin
    model = build_model(name)
    if accelerator.is_main_process:
        model.config.save_pretrained(out)
    if lora:
        model = wrapped(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(SEED))
    loss = model(input_ids=tokens, labels=tokens).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.save_state(str(out / "state"))
    full = {
        name: value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in model.state_dict().items()
    }
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    if accelerator.is_main_process:
        truth = {"model": full, "input_ids": tokens, "logits": logits}
        if lora:
            truth.update(lora_truth(full, tokens))
        torch.save(truth, out / "truth.pt")
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    kind = sys.argv[2] if len(sys.argv) > 2 else "SHARDED_STATE_DICT"
    lora = len(sys.argv) > 3 and sys.argv[3] == "lora"
    name = "gpt_oss" if len(sys.argv) > 3 and sys.argv[3] == "gpt_oss" else "qwen3"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    mp.start_processes(
        worker, args=(port, out, kind, lora, name), nprocs=WORLD, start_method="fork"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
