"""``ckptctl merge-lora`` against what users run otherwise: PEFT's ``merge_and_unload`` and
``save_pretrained``, side by side in one run, with ``cp -r`` of the base for the machine's
copy speed.

Builds once (kept in ``--workdir``): a Llama of ``--hidden`` and ``--layers`` (vocabulary 32000,
untied) saved by transformers in bfloat16, and a PEFT LoRA adapter of rank ``--rank`` on every
linear layer of it, its matrices seeded random (B is zero at PEFT's initialisation). With
``--experts N``: a Qwen3-MoE of N experts a layer instead, the adapter on its attention and on
its packed experts (``target_parameters``: how LoRA on experts is trained under transformers
5). Then times, best of ``--repeat``, attempts round robin, each a fresh process:

* ``cp -r`` of the base;
* PEFT: the base loaded by transformers, the adapter by ``PeftModel.from_pretrained``,
  ``merge_and_unload()``, ``save_pretrained`` (safetensors);
* ``ckptctl merge-lora BASE ADAPTER OUT`` under ``--memory-budget``.

``ckptctl verify OURS --against PEFT`` then says how far apart the two are: PEFT on a bfloat16
model rounds the delta to bfloat16 before adding it, ckptctl adds in float32 and rounds once,
so a few elements differ by one bfloat16 step; the bench fails beyond ``2**-6`` relative.

    python bench/bench_merge_lora.py [--workdir /tmp/ckptctl-bench-lora] [--hidden 2048]
        [--layers 8] [--rank 16] [--budget 1GiB] [--repeat 2] [--keep]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchlib import Timing, attempt, compile_bytecode, du, memory_needed, remove

HERE = Path(__file__).resolve().parent
BUILD = """
import sys, torch, transformers, peft
hidden, layers, rank, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
experts = int(sys.argv[5])
sizes = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
torch.manual_seed(0)
if experts:
    config = transformers.Qwen3MoeConfig(
        **sizes, intermediate_size=hidden * 11 // 4, moe_intermediate_size=hidden // 2,
        num_experts=experts, num_experts_per_tok=4, head_dim=hidden // 16)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
else:
    config = transformers.LlamaConfig(**sizes, intermediate_size=hidden * 11 // 4)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out + "/base", max_shard_size="1GB")
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
if experts:
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
else:
    targets += ["gate_proj", "up_proj", "down_proj"]
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
wrapped = peft.get_peft_model(model, lora)
seeded = torch.Generator().manual_seed(1)
with torch.no_grad():
    for name, p in wrapped.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=seeded) * 0.01)
wrapped.save_pretrained(out + "/adapter")
"""
PEFT_MERGE = """
import sys, torch, transformers, peft
base, adapter, out = sys.argv[1:4]
model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
merged.save_pretrained(out, max_shard_size="5GB")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-lora"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--experts", type=int, default=0, help="A Qwen3-MoE of this many.")
    args = parser.parse_args()
    work = args.workdir
    built = work / f"h{args.hidden}-l{args.layers}-r{args.rank}-e{args.experts}"
    if not (built / "adapter" / "adapter_model.safetensors").exists():
        remove(built)
        built.mkdir(parents=True)
        command = [sys.executable, "-c", BUILD, str(args.hidden), str(args.layers)]
        subprocess.run([*command, str(args.rank), str(built), str(args.experts)], check=True)
    base, adapter = built / "base", built / "adapter"
    compile_bytecode()
    size = du(base)
    runs = {
        "cp -r": ["cp", "-r", str(base), str(work / "cp")],
        "PEFT merge_and_unload + save_pretrained": [
            sys.executable,
            "-c",
            PEFT_MERGE,
            str(base),
            str(adapter),
            str(work / "peft"),
        ],
        f"ckptctl merge-lora (--memory-budget {args.budget})": [
            sys.executable,
            "-m",
            "ckptctl",
            "merge-lora",
            str(base),
            str(adapter),
            str(work / "ours"),
            "--memory-budget",
            args.budget,
        ],
    }
    outs = dict(zip(runs, (work / "cp", work / "peft", work / "ours"), strict=True))
    best: dict[str, Timing] = {}
    for _ in range(args.repeat):
        for name, line in runs.items():
            timing = attempt(line, outs[name], need=memory_needed(size))
            if name not in best or timing.seconds < best[name].seconds:
                best[name] = timing
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptctl",
            "verify",
            str(work / "ours"),
            "--against",
            str(work / "peft"),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    tensors = json.loads(report.stdout)["tensors"]
    worst = max(t["max_abs_diff"] for t in tensors)
    cp = best["cp -r"].seconds
    model = f"Qwen3-MoE, {args.experts} experts a layer" if args.experts else "Llama"
    lora = "attention and packed experts" if args.experts else "every linear layer"
    print(
        f"base {size / 1e9:.2f} GB ({model}, bf16, {args.layers} layers, hidden "
        f"{args.hidden}), adapter rank {args.rank} on {lora}, best of {args.repeat}\n"
    )
    print("| run | seconds | vs cp -r | peak RSS |")
    print("|---|---:|---:|---:|")
    for name, timing in best.items():
        seconds, rss = timing.seconds, timing.rss
        print(f"| {name} | {seconds:.2f} | {seconds / cp:.2f}x | {rss / 2**20:.0f} MiB |")
    print(f"\nckptctl vs PEFT: {len(tensors)} tensors compared, largest difference {worst:.3g}")
    if not args.keep:
        for out in outs.values():
            remove(out)
    if worst > 2**-6:
        sys.exit("ckptctl's merge differs from PEFT's by more than bfloat16 rounding")


if __name__ == "__main__":
    main()
