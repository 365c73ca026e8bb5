"""How long planning takes, and the memory it holds, for the largest plans: a 405B-class dense
model (126 layers, hidden 16384, TP8 PP16 -> TP16 PP8, uneven first/last stages), the
DeepSeek-V3 shape (61 layers, the first three dense, 256 routed experts and a shared one in
the others, multi-latent attention, one multi-token prediction layer on the last stage; EP64
PP16 -> EP32 PP8) and the Kimi K2 shape (1T parameters: 61 layers, the first dense, 384 routed
experts and a shared one, multi-latent attention with 64 heads; EP64 PP16 -> EP32 PP8), all
with Adam state. Pure planning, no I/O but the plan's JSON, written streaming to a temporary
file; then the shares of 512 workers (``plan --workers 512``).

    python bench/bench_plan.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from ckptctl.formats.megatron_common.layout import megatron_files
from ckptctl.formats.megatron_common.target import MegatronTarget
from ckptctl.model.geometry import nbytes
from ckptctl.model.layout import ModelSpec, ParallelLayout, RouterScore
from ckptctl.model.megatron_style import MegatronStyle, OptimizerLayout
from ckptctl.model.mla import MlaSpec, RopeType
from ckptctl.model.plan import FileWrite
from ckptctl.model.stored import CheckpointView, Format
from ckptctl.model.target import TargetRequest
from planners.shares import split_files
from planners.strategy import Stored, plan_auto

SPEC = ModelSpec(
    num_layers=126,
    hidden_size=16384,
    ffn_hidden_size=53248,
    num_attention_heads=128,
    num_query_groups=16,
    kv_channels=128,
    vocab_size=128256,
)
SOURCE = ParallelLayout(tp=8, pp=16, first_stage_layers=7, last_stage_layers=7)
TARGET = ParallelLayout(tp=16, pp=8, first_stage_layers=15, last_stage_layers=15)

DEEPSEEK_V3 = ModelSpec(
    num_layers=61,
    hidden_size=7168,
    ffn_hidden_size=18432,
    num_attention_heads=128,
    num_query_groups=128,
    kv_channels=192,
    vocab_size=129280,
    norm_epsilon=1e-6,
    qk_layernorm=True,
    mla=MlaSpec(
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        rope_type=RopeType.YARN,
        scaling_factor=40.0,
        original_max_position_embeddings=4096,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    num_experts=256,
    moe_ffn_hidden_size=2048,
    moe_router_topk=8,
    moe_router_score_function=RouterScore.SIGMOID,
    moe_router_expert_bias=True,
    moe_shared_expert_intermediate_size=2048,
    moe_router_num_groups=8,
    moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5,
    dense_layers=(0, 1, 2),
    mtp_num_layers=1,
)
DEEPSEEK_SOURCE = ParallelLayout(pp=16, dp=64, ep=64, first_stage_layers=3, last_stage_layers=2)
DEEPSEEK_TARGET = ParallelLayout(pp=8, dp=32, ep=32, first_stage_layers=7, last_stage_layers=6)
KIMI_K2 = DEEPSEEK_V3.model_copy(
    update={
        "num_attention_heads": 64,
        "num_query_groups": 64,
        "vocab_size": 163840,
        "num_experts": 384,
        "dense_layers": (0,),
        "moe_router_num_groups": 1,
        "moe_router_group_topk": 1,
        "moe_router_topk_scaling_factor": 2.827,
        "mtp_num_layers": 0,
    }
)
WORKERS = 512


CASES = {
    "405b": ("405B-class dense, TP8 PP16 -> TP16 PP8", SPEC, SOURCE, TARGET),
    "deepseek-v3": (
        "DeepSeek-V3 + MTP, EP64 PP16 -> EP32 PP8",
        DEEPSEEK_V3,
        DEEPSEEK_SOURCE,
        DEEPSEEK_TARGET,
    ),
    "kimi-k2": ("Kimi K2 (1T), EP64 PP16 -> EP32 PP8", KIMI_K2, DEEPSEEK_SOURCE, DEEPSEEK_TARGET),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=list(CASES), help="plan one case in this process")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(plan_case(*CASES[args.case][1:])))
        return
    # Each case in a fresh process: its own peak RSS, and no warm caches from another case.
    print(
        "Planning with Adam state, no I/O but the plan's JSON (written streaming to a temporary "
        f"file); {os.cpu_count()} CPUs"
    )
    print(
        "| checkpoint | files | tensors | copies | source view s | plan s | plan JSON "
        f"| JSON written s | {WORKERS} workers' shares s | peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (title, *_) in CASES.items():
        done = subprocess.run(
            [sys.executable, __file__, "--case", name], capture_output=True, text=True, check=True
        )
        r = json.loads(done.stdout.splitlines()[-1])
        print(
            f"| {title} | {r['source_files']} -> {r['target_files']} | {r['tensors']:,} "
            f"| {r['copies']:,} | {r['view_s']:.2f} | {r['plan_s']:.2f} "
            f"| {r['json_bytes'] / 1e6:.0f} MB | {r['json_s']:.2f} | {r['shares_s']:.2f} "
            f"| {r['rss_mib']:.0f} MiB |"
        )


def plan_case(spec: ModelSpec, source: ParallelLayout, wanted: ParallelLayout) -> dict[str, Any]:
    started = time.perf_counter()
    optimizer = OptimizerLayout()
    files = megatron_files(
        spec, source, iteration=1000, weight_dtype="bfloat16", optimizer=optimizer
    )
    view = CheckpointView(Format.MEGATRON, spec, source, files, 1000, True)
    stored = Stored(view, "/lake/ckpt", "0" * 16, {f.path: 0 for f in files})
    probed = time.perf_counter()
    plan = plan_auto(
        stored,
        [],
        wanted,
        target_url="/nvme/new",
        target=MegatronTarget(),
        request=TargetRequest(style=MegatronStyle(optimizer=optimizer)),
    )
    planned = time.perf_counter()
    with tempfile.TemporaryFile("w") as saved:
        saved.writelines(plan.json_parts())
        size = saved.tell()
    written = time.perf_counter()
    split_files(plan.files, [nbytes_of(f) for f in plan.files], WORKERS)
    shared = time.perf_counter()
    return {
        "source_files": len(files),
        "target_files": len(plan.files),
        "tensors": sum(len(f.tensors) for f in plan.files),
        "copies": sum(len(t.copies) for f in plan.files for t in f.tensors),
        "view_s": probed - started,
        "plan_s": planned - probed,
        "json_bytes": size,
        "json_s": written - planned,
        "shares_s": shared - written,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def nbytes_of(file: FileWrite) -> int:
    return sum(nbytes(t.shape, t.dtype) for t in file.tensors)


if __name__ == "__main__":
    main()
