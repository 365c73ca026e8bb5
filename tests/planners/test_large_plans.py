"""What makes the largest plans fast must not change them: the view's tensors shared between
expert-parallel files, the planner's caches keyed by object identity, the plan written and
hashed a file at a time. (How fast they are, ``bench/bench_plan.py`` measures.)"""

from __future__ import annotations

import json
from dataclasses import replace

from ckptctl.formats.megatron_common.layout import megatron_files
from ckptctl.formats.megatron_common.target import MegatronTarget
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import MegatronStyle, OptimizerLayout
from ckptctl.model.plan import Plan, coverage_problems
from ckptctl.model.stored import CheckpointView, Format, StoredFile
from ckptctl.model.target import TargetRequest
from planners.strategy import Stored, plan_auto
from tests.planners.test_planners import SPEC

MOE = ModelSpec.model_validate(
    SPEC.model_dump()
    | {
        "num_layers": 4,
        "num_experts": 8,
        "moe_ffn_hidden_size": 32,
        "moe_router_topk": 2,
        "dense_layers": (0,),
    }
)
"""The planner tests' model with experts in every layer but the first."""
SOURCE = ParallelLayout(pp=2, dp=4, ep=4)
TARGET = ParallelLayout(pp=2, dp=2, ep=2)
"""(Every stage keeps a MoE layer: a stage of the dense layer alone is refused with optimizer
state, ``formats.megatron_common.target.refuse_stages_without_experts``.)"""
OPT = OptimizerLayout()


def _plan(files: tuple[StoredFile, ...]) -> Plan:
    view = CheckpointView(Format.MEGATRON, MOE, SOURCE, files, 7, True)
    return plan_auto(
        Stored(view, "/a", "f" * 16, {f.path: 1000 for f in files}),
        [],
        TARGET,
        target_url="/b",
        target=MegatronTarget(),
        request=TargetRequest(style=MegatronStyle(optimizer=OPT)),
    )


def _unshared(files: tuple[StoredFile, ...]) -> tuple[StoredFile, ...]:
    """The same files with every tensor and piece a distinct object."""
    return tuple(
        replace(
            f,
            tensors=tuple(
                replace(t, pieces=tuple(replace(p) for p in t.pieces)) for t in f.tensors
            ),
        )
        for f in files
    )


def test_a_plan_is_the_same_whether_files_share_their_tensors_or_not() -> None:
    files = megatron_files(MOE, SOURCE, iteration=7, weight_dtype="bfloat16", optimizer=OPT)
    first_stage = [f for f in files if f.rank == (0, 0)]
    assert len(first_stage) == SOURCE.ep
    # The EP ranks' files of a stage share their dense tensors (the test is of that path) ...
    dense = [t for t in first_stage[0].tensors if ".experts." not in t.canonical]
    held = {id(t) for t in first_stage[1].tensors}
    assert dense and all(id(t) in held for t in dense)
    # ... and hold their own experts.
    experts = {t.canonical for f in first_stage for t in f.tensors if ".experts." in t.canonical}
    per_file = sum(1 for t in first_stage[0].tensors if ".experts." in t.canonical)
    assert per_file and len(experts) == SOURCE.ep * per_file
    shared, apart = _plan(files), _plan(_unshared(files))
    assert coverage_problems(shared) == []
    assert shared.files == apart.files and shared.estimates == apart.estimates
    assert shared.fingerprint() == apart.fingerprint()


def test_a_plan_written_a_file_at_a_time_reads_back_whole() -> None:
    plan = _plan(megatron_files(MOE, SOURCE, iteration=7, weight_dtype="bfloat16", optimizer=OPT))
    text = "".join(plan.json_parts())
    lines = text.splitlines()  # the plan's fields, a line per target file, the closing brackets
    assert len(lines) == len(plan.files) + 2 and lines[-1] == "]}"
    assert Plan.model_validate_json(text) == plan
    assert Plan.model_validate_json(text).fingerprint() == plan.fingerprint()
    with_workers = json.loads("".join(plan.json_parts({"workers": {"shares": [[0], [1]]}})))
    assert with_workers["workers"] == {"shares": [[0], [1]]}
    assert Plan.model_validate({k: v for k, v in with_workers.items() if k != "workers"}) == plan
    # The fingerprint remembered for a plan is not another plan's, even one copied from it.
    changed = plan.model_copy(update={"target_url": "/c"})
    assert changed.fingerprint() != plan.fingerprint()
    assert (
        changed.fingerprint()
        == Plan.model_validate_json("".join(changed.json_parts())).fingerprint()
    )
