"""Mixture-of-experts layouts and namings beyond what megatron-core writes on CPU (issue 15).

A tiny transformers Mixtral is the source; ckptctl cuts it into Megatron layouts with expert
parallelism. The expert modules megatron-core names differently (``TEGroupedMLP`` under
TransformerEngine with grouped GEMM, ``GroupedMLP`` without it) follow the target's ``args``;
what is not supported yet is refused by name, and nothing is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.MixtralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("mixtral") / "hf"
    transformers.MixtralForCausalLM(config).save_pretrained(out)
    return out


def _set_args(root: Path, **fields: object) -> None:
    """Rewrite ``args`` in every rank file, as a run with other settings would have saved."""
    for path in root.rglob("model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        args: argparse.Namespace = state["args"]
        for name, value in fields.items():
            setattr(args, name, value)
        torch.save(state, path)


def _model_keys(path: Path) -> list[str]:
    return list(torch.load(path, weights_only=False)["model"])


def test_te_grouped_experts_follow_the_targets_args(mixtral: Path, tmp_path: Path, cli) -> None:
    ep2 = tmp_path / "ep2"
    cli("reshard", mixtral, ep2, "--ep", "2", "--dp", "2")
    keys = _model_keys(ep2 / "release" / "mp_rank_00_001" / "model_optim_rng.pt")
    assert "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight" in keys

    _set_args(ep2, moe_grouped_gemm=True, transformer_impl="transformer_engine")
    grouped = tmp_path / "grouped"
    cli("reshard", ep2, grouped, "--tp", "2", "--ep", "2", "--dp", "2")
    keys = _model_keys(grouped / "release" / "mp_rank_01_001" / "model_optim_rng.pt")
    layer = [k.removeprefix("decoder.layers.0.") for k in keys if k.startswith("decoder.layers.0.")]
    # TEGroupedMLP: one grouped linear per projection, local expert j as weight<j>, in the
    # module order megatron-core registers them; the attention norm fused into linear_qkv.
    assert layer == [
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight",
        "pre_mlp_layernorm.weight",
        "mlp.router.weight",
        "mlp.experts.linear_fc1.weight0",
        "mlp.experts.linear_fc1.weight1",
        "mlp.experts.linear_fc2.weight0",
        "mlp.experts.linear_fc2.weight1",
    ]
    # Read back (names tell the expert module) and every tensor is the source's.
    back = tmp_path / "hf"
    cli("consolidate", grouped, back, "--format", "hf")
    assert cli.json("verify", back, "--against", mixtral)["ok"]


def test_grouped_mlp_experts_follow_the_targets_args(mixtral: Path, tmp_path: Path, cli) -> None:
    src = tmp_path / "src"
    cli("reshard", mixtral, src, "--ep", "2", "--dp", "2")
    _set_args(src, moe_grouped_gemm=True, transformer_impl="local")
    grouped = tmp_path / "grouped"
    cli("reshard", src, grouped, "--tp", "2", "--ep", "2", "--dp", "2")
    state = torch.load(
        grouped / "release" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False
    )
    layer = {
        k.removeprefix("decoder.layers.0."): tuple(v.shape)
        for k, v in state["model"].items()
        if k.startswith("decoder.layers.0.mlp.experts.")
    }
    # GroupedMLP: one parameter per projection for both local experts, each expert's TP shard
    # transposed: fc1 [hidden, 2 x (2 x 32 / 2)], fc2 [2 x (32 / 2), hidden].
    assert layer == {"mlp.experts.weight1": (64, 64), "mlp.experts.weight2": (32, 64)}
    back = tmp_path / "hf"
    cli("consolidate", grouped, back, "--format", "hf")
    assert cli.json("verify", back, "--against", mixtral)["ok"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--ep", "3", "--dp", "3"], "ep=3 does not divide num_experts=4"),
        (["--ep", "2"], "ep=2 x etp=1 does not divide tp=1 x dp=1"),
        (
            ["--etp", "2", "--ep", "2", "--dp", "4"],
            "legacy rank files collide (mp_rank_00_000, mp_rank_00_001: each written by",
        ),
        (
            ["--tp", "2", "--etp", "1", "--dp", "2"],
            "legacy rank files would leave out dense TP shards [1]",
        ),
    ],
)
def test_unsupported_expert_layouts_are_refused(
    mixtral: Path, tmp_path: Path, cli, options: list[str], message: str
) -> None:
    result = cli("reshard", mixtral, tmp_path / "out", *options, code=2)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_and_plan_show_experts_per_rank(mixtral: Path, tmp_path: Path, cli) -> None:
    ep4 = tmp_path / "ep4"
    cli("reshard", mixtral, ep4, "--ep", "4", "--dp", "4", "--tp", "2")
    info = cli.json("inspect", ep4)
    assert info["layout"]["ep"] == 4
    assert {(tuple(f["rank"]), f["ep_rank"]): f["experts"] for f in info["files"]} == {
        ((t, 0), e): [e] for t in range(2) for e in range(4)
    }
    text = cli("inspect", ep4).stdout
    assert "experts: 1 of 4 per EP rank (EP4)" in text
    plan = cli.json("plan", ep4, "--tp", "1", "--ep", "2", "--dp", "4")
    assert plan["target_layout"]["ep"] == 2


def test_lost_expert_rank_is_recovered_from_the_full_copy(
    mixtral: Path, tmp_path: Path, cli
) -> None:
    ep2 = tmp_path / "ep2"
    cli("reshard", mixtral, ep2, "--ep", "2", "--dp", "2")
    # Global rank 1 is EP rank 1 (experts 2-3): its file is lost; the dense part comes from
    # EP rank 0's file, the experts from the HF copy.
    options = ["--ep", "2", "--dp", "2", "--lost-ranks", "1", "--full", str(mixtral)]
    plan = cli.json("plan", ep2, *options)
    assert plan["strategy"] == "recovery"
    cli("reshard", ep2, tmp_path / "healed", *options)
    assert cli.json("verify", tmp_path / "healed", "--against", mixtral)["ok"]
    assert cli.json("plan", ep2, "--ep", "2", "--dp", "2")["strategy"] == "direct"


@pytest.mark.parametrize(
    ("tp", "dp", "pp", "ep", "etp"),
    [(2, 2, 1, 2, 1), (2, 4, 2, 2, 2), (4, 2, 1, 2, 2), (1, 4, 2, 4, 1), (2, 4, 1, 4, 1)],
)
def test_rank_coordinates_are_megatron_cores(tp: int, dp: int, pp: int, ep: int, etp: int) -> None:
    """Which file a rank writes depends on where it sits in the dense and the expert groups:
    megatron-core's own RankGenerator (the one its parallel_state builds) is the judge."""
    state = pytest.importorskip("megatron.core.parallel_state")
    from ckptctl.formats.megatron_common.ranks import coords
    from ckptctl.model.layout import ParallelLayout

    layout = ParallelLayout(tp=tp, dp=dp, pp=pp, ep=ep, etp=etp)
    world = tp * dp * pp
    order = "tp-cp-ep-dp-pp"
    dense = state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    experts = state.RankGenerator(
        tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order
    )
    want: dict[int, dict[str, int]] = {rank: {} for rank in range(world)}
    for generator, token, field in (
        (dense, "tp", "tp"),
        (dense, "dp", "dp"),
        (dense, "pp", "pp"),
        (experts, "tp", "etp"),
        (experts, "ep", "ep"),
        (experts, "dp", "expert_dp"),
    ):
        for group in generator.get_ranks(token):
            for position, rank in enumerate(group):
                want[rank][field] = position
    for rank in range(world):
        c = coords(layout, rank)
        assert {field: getattr(c, field) for field in want[rank]} == want[rank], rank
