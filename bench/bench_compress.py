"""Compressed checkpoints: ratio and throughput of ``ckptctl compress`` (alone, and as a delta
against the previous checkpoint of the same run) against plain ``zstd`` of the same files and
``cp -r``, in one run, with peak RSS; then ``decompress``. Two more rows show the opt-in lossy
``--quantize`` (int8 per block of 256: weights only, then optimizer state too).

The checkpoints are consecutive steps of a real (small) training run: a transformers Llama
trained on CPU with AdamW (lr 1e-4), saved with ``ckptctl.save`` (DCP: fp32 weights, Adam
``exp_avg`` and ``exp_avg_sq``) after each step.

    python bench/bench_compress.py [--workdir /tmp/ckptctl-bench-compress] [--hidden 768]
        [--layers 6] [--vocab 16000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from benchlib import du, measure, remove

GENERATE = """
import sys, torch, ckptctl
from transformers import LlamaConfig, LlamaForCausalLM
out, hidden, layers, vocab = sys.argv[1], *map(int, sys.argv[2:5])
torch.manual_seed(0)
config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                     num_hidden_layers=layers, num_attention_heads=hidden // 64,
                     num_key_value_heads=hidden // 128, tie_word_embeddings=False)
model = LlamaForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(4):
    x = torch.randint(0, vocab, (2, 64))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    if step >= 2:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        ckptctl.save(state, checkpoint_id=f"{out}/step_{step}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptctl-bench-compress"))
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work = args.workdir
    shape = (args.hidden, args.layers, args.vocab)
    stamp = work / "shape"
    if not stamp.exists() or stamp.read_text() != repr(shape):
        remove(work)
        work.mkdir(parents=True)
        subprocess.run([sys.executable, "-c", GENERATE, str(work), *map(str, shape)], check=True)
        stamp.write_text(repr(shape))
    base, src = work / "step_2", work / "step_3"
    size = du(src)
    ckptctl = [sys.executable, "-m", "ckptctl"]
    zstd_out = work / "zstd"
    zstd = [
        "bash",
        "-c",
        f"mkdir -p {zstd_out} && zstd -q -3 -T0 {src}/* --output-dir-flat {zstd_out}",
    ]
    runs = [
        ("cp -r", ["cp", "-r", str(src), str(work / "copy")], work / "copy"),
        ("zstd -3 -T0 (plain)", zstd, zstd_out),
        ("ckptctl compress", [*ckptctl, "compress", str(src), str(work / "alone")], work / "alone"),
        (
            "ckptctl compress --base previous step",
            [*ckptctl, "compress", str(src), str(work / "delta"), "--base", str(base)],
            work / "delta",
        ),
        (
            "ckptctl compress --quantize weights (LOSSY)",
            [*ckptctl, "compress", str(src), str(work / "qw"), "--quantize", "weights"],
            work / "qw",
        ),
        (
            "ckptctl compress --quantize all (LOSSY)",
            [*ckptctl, "compress", str(src), str(work / "qa"), "--quantize", "all"],
            work / "qa",
        ),
    ]
    rows = measure(runs, size, args.repeat, keep=[work / "delta"])
    restore = [
        ("cp -r", ["cp", "-r", str(src), str(work / "copy")], work / "copy"),
        (
            "ckptctl decompress (delta)",
            [*ckptctl, "decompress", str(work / "delta"), str(work / "restored")],
            work / "restored",
        ),
    ]
    back = measure(restore, size, args.repeat)
    remove(work / "delta")
    print(f"\n{src}: {size / 1e9:.3f} GB (DCP, fp32 weights + AdamW state, step 3 of a run)\n")
    print("| run | seconds | stored GB | ratio | GB/s in | vs cp | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, seconds, _, written, rate, ratio, rss in rows + back[1:]:
        stored = (
            f"{written / 1e9:.3f} | {size / written:.2f}" if "decompress" not in name else "- | -"
        )
        print(
            f"| {name} | {seconds:.2f} | {stored} | "
            f"{rate / 1e9:.2f} | {ratio:.2f}x | {rss / 2**20:.0f} MiB |"
        )
    print(f"\ndecompress vs cp: {back[1][5]:.2f}x (cp {back[0][1]:.2f} s)")


if __name__ == "__main__":
    main()
