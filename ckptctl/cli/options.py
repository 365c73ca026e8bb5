"""Every option the commands share, as ``Annotated`` aliases, and the settings they build.

Global options (storage, ``--allow-incomplete``, ``--hf-config``, ``--debug``) are read once by the
root command into a ``CliState``; each command adds its own (memory budget, checksum, staging)
with ``command_settings``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from ckptctl.cli.global_options import CliState, state
from ckptctl.cli.option_values import parse_size, read_hf_config, storage_config, with_options
from ckptctl.formats import registry
from ckptctl.formats.target import RESHARD
from ckptctl.model.target import FP8_BLOCK, MXFP4
from ckptctl.settings import Settings

__all__ = [
    "CliState",
    "parse_size",
    "read_hf_config",
    "state",
    "storage_config",
    "with_options",
]


def command_settings(ctx: typer.Context, **changes: Any) -> Settings:
    """The invocation's settings with this command's own options applied."""
    return dataclasses.replace(state(ctx).settings, **changes)


class DType(StrEnum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"
    fp8_block = "fp8-block"
    mxfp4 = "mxfp4"


WEIGHT_DTYPES = {
    DType.bf16: "bfloat16",
    DType.fp16: "float16",
    DType.fp32: "float32",
    DType.fp8_block: FP8_BLOCK,
    DType.mxfp4: MXFP4,
}
"""``--dtype`` choices as torch dtype names."""

WeightDType = Annotated[
    DType | None,
    typer.Option(
        "--dtype",
        help="Convert weights (optimizer stays fp32); fp8-block: linear weights in FP8 with "
        "128x128 block scales, as DeepSeek-V3 releases them; mxfp4: GPT-OSS's expert weights "
        "in MXFP4, as OpenAI releases them (--format hf only; lossy, each weight's error "
        "recorded and held by verify --against).",
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
Iteration = Annotated[
    int | None, typer.Option("--iteration", help="Iteration to read instead of the tracker's.")
]
TrueVocab = Annotated[
    int | None,
    typer.Option(
        "--true-vocab-size",
        help="Real vocabulary size when args do not record it (padding rows are dropped).",
    ),
]
MemoryBudget = Annotated[
    str,
    typer.Option("--memory-budget", help="Tensor data held in memory at once (e.g. 512MiB, 2GiB)."),
]
Tp = Annotated[
    int | None, typer.Option("--tp", help="Target tensor-parallel size (default: the source's).")
]
Pp = Annotated[
    int | None,
    typer.Option("--pp", help="Target pipeline-parallel size (default: the source's)."),
]
Vpp = Annotated[
    int | None,
    typer.Option(
        "--vpp",
        help="Virtual pipeline chunks per stage (default: the source's, where it still fits).",
    ),
]
Ep = Annotated[
    int | None,
    typer.Option("--ep", help="Target expert-parallel size, MoE models (default: the source's)."),
]
Etp = Annotated[
    int | None,
    typer.Option("--etp", help="Target expert tensor-parallel size (default: the source's)."),
]
Dp = Annotated[
    int | None, typer.Option("--dp", help="Target data-parallel size (default: the source's).")
]
FsdpSize = Annotated[
    int | None,
    typer.Option(
        "--fsdp-size",
        min=1,
        help="--format verl: ranks each parameter is sharded over (HSDP's shard group, verl's "
        "fsdp_size; --dp for one flat FSDP2 mesh). Default: the source's.",
    ),
]
DistOpt = Annotated[
    bool | None,
    typer.Option(
        "--distributed-optimizer/--no-distributed-optimizer",
        help="Write optimizer state as distrib_optim.pt (default: as the source).",
    ),
]
FirstStage = Annotated[
    int | None,
    typer.Option(
        "--pp-first-stage-layers",
        help="Layers on the first stage (default: the source's while PP is unchanged).",
    ),
]
EvenStages = Annotated[
    bool,
    typer.Option(
        "--even-stages",
        help="Split layers evenly over the pipeline stages, whatever the source's split.",
    ),
]
LastStage = Annotated[
    int | None,
    typer.Option(
        "--pp-last-stage-layers",
        help="Layers on the last stage (default: the source's while PP is unchanged).",
    ),
]
Full = Annotated[
    list[str] | None,
    typer.Option("--full", help="A full checkpoint of the same state (HF or TP1 PP1)."),
]
Replica = Annotated[
    list[str] | None,
    typer.Option("--replica", help="Another stored copy of the same sharded checkpoint."),
]
LostRanks = Annotated[
    str | None, typer.Option("--lost-ranks", help="Global ranks whose files are lost: 0,3,8-11.")
]
LostNodes = Annotated[
    str | None,
    typer.Option("--lost-nodes", help="Nodes whose files are lost (with --ranks-per-node)."),
]
RanksPerNode = Annotated[int | None, typer.Option("--ranks-per-node", help="Ranks per node.")]


class StrategyName(StrEnum):
    auto = "auto"
    direct = "direct"
    shard_to_shard = "shard-to-shard"
    recovery = "recovery"
    full_then_split = "full-then-split"


Strategy = Annotated[
    StrategyName,
    typer.Option("--strategy", help="How to reach the target (auto: the cheapest valid one)."),
]
PlanFile = Annotated[
    Path | None, typer.Option("--plan", help="Run exactly this saved plan (from ckptctl plan).")
]


class ChecksumName(StrEnum):
    xxh3_64 = "xxh3_64"
    sha256 = "sha256"


class OptimShardingName(StrEnum):
    """How a ``torch_dist`` target keeps the distributed optimizer's state."""

    dp_reshardable = "dp_reshardable"
    fully_reshardable = "fully_reshardable"
    fully_sharded_model_space = "fully_sharded_model_space"


OptimSharding = Annotated[
    OptimShardingName | None,
    typer.Option(
        "--optim-sharding",
        help="torch_dist with the distributed optimizer: dp_reshardable (its grad-buffer "
        "buckets, Megatron's default), fully_reshardable (per parameter) or "
        "fully_sharded_model_space (per parameter, N-D flattened: what megatron-core <= 0.14 "
        "reads) (default: the source's form; fully_reshardable from other sources).",
    ),
]


def _targets(operation: str, first: str) -> list[str]:
    """The registered target formats of ``operation``, ``first`` (the default) first."""
    names = [t.name for t in registry.targets(operation)]
    return sorted(names, key=lambda n: n != first)


def format_option(operation: str, first: str, default: str | None = None) -> Any:
    """``--format``: its choices and help from the registry (a new target format appears here
    by being registered)."""
    described = {t.name: t.help for t in registry.targets(operation)}
    names = _targets(operation, first)
    return typer.Option(
        "--format",
        metavar=f"<{'|'.join(names)}>",
        help="; ".join(f"{n}: {described[n]}" for n in names)
        + (f" (default: {default})." if default else "."),
    )


ReshardFormat = Annotated[
    str | None, format_option(RESHARD, "megatron", "the source's, megatron for other sources")
]


StageDir = Annotated[
    str | None,
    typer.Option(
        "--stage-dir",
        help="Write files to this local directory first and upload them in the background; "
        "the manifest goes up after the last upload.",
    ),
]
Checksum = Annotated[
    ChecksumName,
    typer.Option("--checksum", help="File checksum recorded in the manifest."),
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Plan only; write nothing.")]
Workers = Annotated[
    int,
    typer.Option(
        "--workers",
        min=1,
        help="Run the job as this many processes on this machine, each writing its share of "
        "the files (as under torchrun, which ckptctl also runs on); the manifest is written "
        "once every process has finished.",
    ),
]
CheckWorkers = Annotated[
    int,
    typer.Option(
        "--workers",
        min=1,
        help="Check with this many processes on this machine (as under torchrun, which "
        "ckptctl also runs on), each reading its share of the files.",
    ),
]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Replace an existing checkpoint at the destination.")
]


def layout_choices(
    tp: int | None,
    pp: int | None,
    vpp: int | None,
    dp: int | None,
    first: int | None,
    last: int | None,
    distributed_optimizer: bool | None,
    ep: int | None = None,
    etp: int | None = None,
    even_stages: bool = False,
) -> dict[str, Any]:
    """The target layout as given on the command line; ``None`` keeps the source's choice
    (``planners.target``)."""
    return {
        "even_stages": even_stages or None,
        "ep": ep,
        "etp": etp,
        "tp": tp,
        "pp": pp,
        "vpp": vpp,
        "dp": dp,
        "first_stage_layers": first,
        "last_stage_layers": last,
        "distributed_optimizer": distributed_optimizer,
    }


@dataclass(frozen=True)
class TargetRequest:
    """The target layout and the stored copies to reach it from, as ``plan`` and ``reshard``
    take them."""

    layout: dict[str, Any]
    full: list[str] | None
    replicas: list[str] | None
    lost_ranks: str | None
    lost_nodes: str | None
    ranks_per_node: int | None
    strategy: str
    target_format: str | None
    optim_sharding: str | None = None
    shard_group: int | None = None

    def given(self) -> dict[str, Any]:
        """The target flags given on the command line, by their names there."""
        names = {
            "tp": "--tp",
            "pp": "--pp",
            "vpp": "--vpp",
            "dp": "--dp",
            "ep": "--ep",
            "etp": "--etp",
            "first_stage_layers": "--pp-first-stage-layers",
            "last_stage_layers": "--pp-last-stage-layers",
            "distributed_optimizer": "--distributed-optimizer",
            "even_stages": "--even-stages",
        }
        out = {names[k]: v for k, v in self.layout.items() if v is not None}
        if self.target_format is not None:
            out["--format"] = self.target_format
        if self.optim_sharding is not None:
            out["--optim-sharding"] = self.optim_sharding
        if self.shard_group is not None:
            out["--fsdp-size"] = self.shard_group
        return out

    def plan_options(self) -> dict[str, Any]:
        """Keyword arguments of ``ckptctl.pipeline.jobs.plan_reshard``."""
        return {
            "full": self.full,
            "replicas": self.replicas,
            "lost_ranks": self.lost_ranks,
            "lost_nodes": self.lost_nodes,
            "ranks_per_node": self.ranks_per_node,
            "strategy": self.strategy,
            "target_format": self.target_format,
            "optim_sharding": self.optim_sharding,
            "shard_group": self.shard_group,
        }


def target_request(
    tp: Tp = None,
    pp: Pp = None,
    vpp: Vpp = None,
    dp: Dp = None,
    ep: Ep = None,
    etp: Etp = None,
    distributed_optimizer: DistOpt = None,
    first: FirstStage = None,
    last: LastStage = None,
    even_stages: EvenStages = False,
    full: Full = None,
    replica: Replica = None,
    lost_ranks: LostRanks = None,
    lost_nodes: LostNodes = None,
    ranks_per_node: RanksPerNode = None,
    strategy: Strategy = StrategyName.auto,
    target_format: ReshardFormat = None,
    optim_sharding: OptimSharding = None,
    fsdp_size: FsdpSize = None,
) -> TargetRequest:
    return TargetRequest(
        layout_choices(tp, pp, vpp, dp, first, last, distributed_optimizer, ep, etp, even_stages),
        full,
        replica,
        lost_ranks,
        lost_nodes,
        ranks_per_node,
        strategy.value,
        target_format,
        optim_sharding.value if optim_sharding is not None else None,
        fsdp_size,
    )
