"""How long planning takes for a 405B-class model: 126 layers, hidden 16384, TP8 PP16 -> TP16
PP8 with optimizer state (uneven first/last stages, as 126 layers need). Pure planning, no I/O.

    python bench/bench_plan.py
"""

from __future__ import annotations

import time

from ckptctl.formats.megatron.layout import megatron_files
from ckptctl.formats.megatron.target import MegatronTarget
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import MegatronStyle, OptimizerLayout
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


def main() -> None:
    started = time.perf_counter()
    optimizer = OptimizerLayout()
    files = megatron_files(
        SPEC, SOURCE, iteration=1000, weight_dtype="bfloat16", optimizer=optimizer
    )
    view = CheckpointView(Format.MEGATRON, SPEC, SOURCE, files, 1000, True)
    stored = Stored(view, "/lake/ckpt", "0" * 16, {f.path: 0 for f in files})
    probed = time.perf_counter()
    plan = plan_auto(
        stored,
        [],
        TARGET,
        target_url="/nvme/new",
        target=MegatronTarget(),
        request=TargetRequest(style=MegatronStyle(optimizer=optimizer)),
    )
    planned = time.perf_counter()
    copies = sum(len(t.copies) for f in plan.files for t in f.tensors)
    tensors = sum(len(f.tensors) for f in plan.files)
    e = plan.estimates
    print(f"405B-class, TP8 PP16 -> TP16 PP8 with Adam state: strategy {plan.strategy}")
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
