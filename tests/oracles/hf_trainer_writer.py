"""Write an HF Trainer checkpoint with transformers' own ``Trainer``: a tiny seeded Llama
(or Qwen2, whose q/k/v biases take no weight decay) trained two steps on CPU with
``save_steps=2``, so ``OUT/checkpoint-2/`` is what the Trainer saves (``model.safetensors``,
``optimizer.pt`` by parameter index, ``scheduler.pt``, ``trainer_state.json``, ...).

Beside it, ``OUT/reference/``: the same trained state by *name*, read off the live optimizer
(each state entry keyed by its parameter object, named through ``named_parameters``) and
saved by torch's ``dcp.save`` as an FSDP2 run of the HF model saves ``{"model", "optim"}``,
with the model's ``config.json`` -- the truth the index-keyed ``optimizer.pt`` must map to.

Usage::

    python tests/oracles/hf_trainer_writer.py OUT_DIR [llama|qwen2] [OPTIM]

``OPTIM``: the Trainer's ``optim`` (default ``adamw_torch``; ``adafactor`` for another
optimizer's state, then without ``reference/``), or ``accelerate``: no Trainer, accelerate's
own ``save_state`` after one AdamW step (``OUT/state/``, its config in ``OUT/config/``). No
CPU shims: the Trainer and accelerate run on the CPU as they are (``use_cpu``, ``cpu=True``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import transformers

SEQ, VOCAB = 12, 301


def model_of(family: str) -> transformers.PreTrainedModel:
    sizes = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    family = argv[1] if len(argv) > 1 else "llama"
    optim = argv[2] if len(argv) > 2 else "adamw_torch"
    model = model_of(family)
    seeded = torch.Generator().manual_seed(1)
    data = []
    for _ in range(8):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=seeded)
        data.append({"input_ids": ids, "labels": ids.clone()})
    if optim == "accelerate":
        write_reference(out, model, accelerate_state(out, model, data))
        return 0
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        save_steps=2,
        save_strategy="steps",
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        weight_decay=0.1,
        optim=optim,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    if optim.startswith("adamw"):  # the by-name reference is of Adam's state
        write_reference(out, model, trainer.optimizer)
    return 0


def accelerate_state(out: Path, model: Any, data: list[dict[str, Any]]) -> Any:
    """accelerate's own loop without FSDP: one AdamW step, ``save_state`` to ``OUT/state``
    (``model.safetensors``, ``optimizer.bin``: no config), the model's config in
    ``OUT/config``. The optimizer, unwrapped."""
    import accelerate

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    runner = accelerate.Accelerator(cpu=True)
    model, optimizer = runner.prepare(model, optimizer)
    batch = torch.stack([d["input_ids"] for d in data[:2]])
    runner.backward(model(input_ids=batch, labels=batch).loss)
    optimizer.step()
    optimizer.zero_grad()
    runner.save_state(str(out / "state"))
    model.config.save_pretrained(str(out / "config"))
    return optimizer.optimizer


def write_reference(out: Path, model: Any, optimizer: Any) -> None:
    """The trained state by name (``OUT/reference``, torch's DCP of ``{"model", "optim"}``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {
        names[id(p)]: {k: v.detach().clone() for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [names[id(p)] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = out / "reference"
    dcp.save(
        {"model": weights, "optim": {"state": state, "param_groups": groups}},
        checkpoint_id=str(reference),
        no_dist=True,
    )
    model.config.save_pretrained(str(reference))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
