"""How long planning takes, and the memory it holds, for the largest plans: a 405B-class dense
model (126 layers, hidden 16384, TP8 PP16 -> TP16 PP8, uneven first/last stages) and the
DeepSeek-V3 shape (61 layers, the first three dense, 256 routed experts and a shared one in
the others, multi-latent attention, one multi-token prediction layer on the last stage; EP64
PP16 -> EP32 PP8), both with Adam state. Pure planning, no I/O.

    python bench/bench_plan.py
"""

from __future__ import annotations

import resource
import time

from ckptctl.formats.megatron.layout import megatron_files
from ckptctl.formats.megatron.target import MegatronTarget
from ckptctl.model.layout import ModelSpec, ParallelLayout, RouterScore
from ckptctl.model.megatron_style import MegatronStyle, OptimizerLayout
from ckptctl.model.mla import MlaSpec, RopeType
from ckptctl.model.stored import CheckpointView, Format
from ckptctl.model.target import TargetRequest
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


def main() -> None:
    plan_case("405B-class, TP8 PP16 -> TP16 PP8", SPEC, SOURCE, TARGET)
    plan_case(
        "DeepSeek-V3 shape, EP64 PP16 -> EP32 PP8", DEEPSEEK_V3, DEEPSEEK_SOURCE, DEEPSEEK_TARGET
    )


def plan_case(name: str, spec: ModelSpec, source: ParallelLayout, wanted: ParallelLayout) -> None:
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
    copies = sum(len(t.copies) for f in plan.files for t in f.tensors)
    tensors = sum(len(f.tensors) for f in plan.files)
    e = plan.estimates
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{name} with Adam state: strategy {plan.strategy}, peak RSS so far {rss:.0f} MiB")
    print(f"  source view built in {probed - started:.3f} s ({len(files)} files)")
    print(
        f"  planned in {planned - probed:.3f} s: {len(plan.files)} target files, "
        f"{tensors} tensors, {copies} copy operations"
    )
    print(
        f"  estimates: read {e.bytes_read / 1e12:.2f} TB in {e.read_requests} requests, "
        f"write {e.bytes_written / 1e12:.2f} TB, ~{e.seconds / 60:.1f} min on local NVMe"
    )


if __name__ == "__main__":
    main()
