"""Checkpoints written by Megatron-LM's own training code (issue 52), judged by Megatron-LM and
transformers: ``parse_args``/``validate_args``, ``setup_model_and_optimizer``, ``train_step``,
``save_checkpoint`` and ``load_checkpoint`` of the megatron-core 0.19.2 wheel, run on the CPU
with gloo by ``tests/oracles/megatron_lm.py`` in an environment of their own
(``tests/megatron_lm_env.py``: Python 3.12, built once and cached).

CPU shims the oracle needs (its docstring has the detail; none touches a stored tensor): CUDA
device calls and streams answered on the CPU, CUDA tensor paths run on the CPU, model
parallelism initialised as ``_initialize_distributed`` does with devices, the RNG tracker seeded
as on a GPU, the GPU architecture told to ``validate_args`` (it picks performance warnings),
torch's Adam under the distributed optimizer's loader (a template step while the state is empty,
Adam's step left as the parameter groups set it),
dataset helpers not compiled (synthetic batches) and the local (non-TransformerEngine) layer
spec.

The model: Llama-like (RoPE, RMSNorm, SwiGLU, no biases, untied embeddings, grouped-query
attention), 4 layers, hidden 64, vocabulary 1000 padded by Megatron to 1024 rows; fp32 weights
and Adam. Dropout is off, so a resumed run's losses depend on the weights, the optimizer state
and the scheduler alone.
"""

from __future__ import annotations

import io
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.megatron_lm_env import train

MODEL = """
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --seq-length 16 --max-position-embeddings 32
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights
    --vocab-size 1000 --make-vocab-size-divisible-by 128 --tokenizer-type NullTokenizer
"""
TRAINING = """
    --micro-batch-size 2 --global-batch-size 2 --train-iters 10 --lr 1e-3 --lr-decay-iters 10
    --attention-dropout 0 --hidden-dropout 0 --mock-data
"""
CPU = """
    --transformer-impl local --distributed-backend gloo --rerun-mode disabled
    --no-rope-fusion --no-gradient-accumulation-fusion --no-bias-swiglu-fusion
    --no-masked-softmax-fusion --no-bias-dropout-fusion --no-persist-layer-norm
"""
ARGS = shlex.split(MODEL + TRAINING + CPU)
SAVED_STEPS = 3
RESUMED_STEPS = 2


def assert_resumes_alike(
    root: Path, load_args: list[str], *, own: Path, ours: Path, world: int = 1
) -> None:
    """Megatron-LM resumes (``load_args`` end with ``--load``) from its own checkpoint and from
    ckptctl's, and trains on with exactly the same losses."""
    mine = train(root / "own", [*load_args, str(own)], world=world, steps=RESUMED_STEPS)
    theirs = train(root / "ours", [*load_args, str(ours)], world=world, steps=RESUMED_STEPS)
    assert theirs["losses"] == mine["losses"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three steps of Megatron-LM, saved in its legacy format (``--ckpt-format torch``), with
    the trained model's logits; and two more steps from that checkpoint (the losses every
    resumed run is held to)."""
    root = tmp_path_factory.mktemp("megatron-lm")
    ckpt, logits = root / "legacy", root / "logits.pt"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    first = train(root / "first", [*ARGS, *save], steps=SAVED_STEPS, logits=logits)
    assert first["iteration"] == SAVED_STEPS
    resumed = train(root / "resumed", [*ARGS, "--load", str(ckpt)], steps=RESUMED_STEPS)
    assert resumed["iteration"] == SAVED_STEPS + RESUMED_STEPS
    return {"root": root, "ckpt": ckpt, "logits": logits, "resumed": resumed["losses"]}


def test_megatron_lms_checkpoint_is_read_whole(saved: dict[str, Any], cli) -> None:
    """Its args (0.19.2: 809 fields) pass as they are; every tensor is located and held."""
    info = cli.json("inspect", saved["ckpt"])
    assert info["format"] == "megatron" and info["iteration"] == SAVED_STEPS
    report = cli.json("verify", saved["ckpt"])
    assert report["ok"], report


def test_its_hf_model_gives_megatrons_logits(saved: dict[str, Any], cli) -> None:
    transformers = pytest.importorskip("transformers")
    hf = saved["root"] / "hf"
    cli("consolidate", saved["ckpt"], hf, "--format", "hf")
    megatron = torch.load(saved["logits"], weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits
    assert logits.shape[-1] == 1000  # the tokenizer's vocabulary, Megatron's padding cut
    # the same fp32 math by two implementations: equal to rounding
    torch.testing.assert_close(logits, megatron["logits"][..., :1000], rtol=0, atol=1e-5)


def test_megatron_lm_resumes_from_a_ckptctl_copy_with_its_own_losses(
    saved: dict[str, Any], cli
) -> None:
    """``consolidate --format megatron`` of a TP1 PP1 checkpoint keeps every rank's state, RNG
    included: Megatron-LM resumes from it (strict, with optimizer, scheduler and RNG) and
    trains on with exactly the losses it has from its own checkpoint."""
    copy = saved["root"] / "copy"
    cli("consolidate", saved["ckpt"], copy, "--format", "megatron")
    resumed = train(saved["root"] / "from-copy", [*ARGS, "--load", str(copy)], steps=RESUMED_STEPS)
    assert resumed["losses"] == saved["resumed"]


def test_megatron_lm_resumes_from_a_tp_round_trip_with_its_own_losses(
    saved: dict[str, Any], cli
) -> None:
    """TP1 -> TP2 -> TP1 by ckptctl: the weights, Adam's state and the vocabulary padding rows
    (trained state: the padded logits are in Megatron's softmax) come back; RNG state, which
    is per TP rank, cannot be resharded (``--no-load-rng``, as Megatron-LM itself ignores it
    when it reshards)."""
    tp2, back = saved["root"] / "tp2", saved["root"] / "tp1-again"
    cli("reshard", saved["ckpt"], tp2, "--tp", "2")
    cli("reshard", tp2, back, "--tp", "1")
    report = cli.json("verify", back, "--against", saved["ckpt"])
    assert report["ok"], report
    resumed = train(
        saved["root"] / "from-round-trip",
        [*ARGS, "--load", str(back), "--no-load-rng"],
        steps=RESUMED_STEPS,
    )
    assert resumed["losses"] == saved["resumed"]


def test_megatron_lm_resumes_at_tp2_from_ckptctls_reshard(saved: dict[str, Any], cli) -> None:
    """Megatron-LM at TP2 loads ckptctl's TP2 checkpoint (strict, optimizer included) and
    trains on: the losses are the TP1 run's up to the rounding of a TP2 all-reduce."""
    tp2 = saved["root"] / "tp2-only"
    cli("reshard", saved["ckpt"], tp2, "--tp", "2")
    resumed = train(
        saved["root"] / "at-tp2",
        [*ARGS, "--tensor-model-parallel-size", "2", "--load", str(tp2), "--no-load-rng"],
        world=2,
        steps=RESUMED_STEPS,
    )
    assert resumed["iteration"] == SAVED_STEPS + RESUMED_STEPS
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(saved["resumed"]), rtol=1e-5, atol=0
    )


@pytest.fixture(scope="module")
def saved_dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three steps saved as ``torch_dist`` (Megatron-LM's default format; 0.19 keeps its common
    state inside the DCP files), with the model's logits; and Megatron-LM's own resumption of it,
    at TP1 and, resharding it itself, at TP2."""
    root = tmp_path_factory.mktemp("megatron-lm-dist")
    ckpt, logits = root / "torch_dist", root / "logits.pt"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch_dist"]
    train(root / "first", [*ARGS, *save], steps=SAVED_STEPS, logits=logits)
    load = ["--ckpt-format", "torch_dist", "--load", str(ckpt)]
    tp1 = train(root / "resumed", [*ARGS, *load], steps=RESUMED_STEPS)
    tp2 = train(
        root / "resumed-tp2",
        [*ARGS, *load, "--tensor-model-parallel-size", "2"],
        world=2,
        steps=RESUMED_STEPS,
    )
    return {
        "root": root,
        "ckpt": ckpt,
        "logits": logits,
        "resumed": tp1["losses"],
        "resumed_tp2": tp2["losses"],
    }


def test_megatron_lms_torch_dist_checkpoint_becomes_hf_with_its_logits(
    saved_dist: dict[str, Any], cli
) -> None:
    transformers = pytest.importorskip("transformers")
    assert cli.json("verify", saved_dist["ckpt"])["ok"]
    hf = saved_dist["root"] / "hf"
    cli("consolidate", saved_dist["ckpt"], hf, "--format", "hf")
    megatron = torch.load(saved_dist["logits"], weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits
    torch.testing.assert_close(logits, megatron["logits"][..., :1000], rtol=0, atol=1e-5)


def test_ckptctls_tp2_torch_dist_resumes_as_megatron_lms_own_reshard(
    saved_dist: dict[str, Any], cli
) -> None:
    """Megatron-LM reshards its TP1 ``torch_dist`` checkpoint to TP2 itself on load; loading
    ckptctl's TP2 reshard instead (its common state, parameter groups, Adam's step and the
    padding rows included) it trains on with exactly the same losses."""
    tp2 = saved_dist["root"] / "tp2"
    cli("reshard", saved_dist["ckpt"], tp2, "--tp", "2")
    load = ["--ckpt-format", "torch_dist", "--load", str(tp2), "--tensor-model-parallel-size", "2"]
    resumed = train(saved_dist["root"] / "from-tp2", [*ARGS, *load], world=2, steps=RESUMED_STEPS)
    assert resumed["losses"] == saved_dist["resumed_tp2"]


def test_torch_dist_and_legacy_convert_both_ways_for_megatron_lm(
    saved: dict[str, Any], saved_dist: dict[str, Any], cli
) -> None:
    """``torch_dist`` -> legacy and legacy -> ``torch_dist`` by ckptctl: Megatron-LM resumes
    from each with the losses it has from the checkpoint converted."""
    legacy = saved_dist["root"] / "as-legacy"
    cli("reshard", saved_dist["ckpt"], legacy, "--format", "megatron")
    resumed = train(
        saved_dist["root"] / "from-legacy",
        [*ARGS, "--load", str(legacy), "--no-load-rng"],
        steps=RESUMED_STEPS,
    )
    assert resumed["losses"] == saved_dist["resumed"]
    dist = saved["root"] / "as-torch-dist"
    cli("reshard", saved["ckpt"], dist, "--format", "torch_dist")
    resumed = train(
        saved["root"] / "from-torch-dist",
        [*ARGS, "--ckpt-format", "torch_dist", "--load", str(dist)],
        steps=RESUMED_STEPS,
    )
    assert resumed["losses"] == saved["resumed"]


def test_megatron_lms_distributed_optimizer_moves_bit_for_bit(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """Megatron-LM's legacy checkpoint with the distributed optimizer (DP2: ``distrib_optim.pt``,
    flat buffers named only by the grad-buffer layout ckptctl replays): its HF model gives
    Megatron's logits, and its optimizer state comes back bit for bit from DP2 -> DP1 without
    the distributed optimizer -> DP2 with it, and Megatron-LM trains on from that with the
    losses it has from its own checkpoint."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("megatron-lm-distopt")
    ckpt, logits = root / "legacy", root / "logits.pt"
    args = [*ARGS, "--use-distributed-optimizer", "--global-batch-size", "4"]
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*args, *save], world=2, steps=SAVED_STEPS, logits=logits)
    assert sorted(p.name for p in ckpt.rglob("*.pt")) == ["distrib_optim.pt", "model_optim_rng.pt"]
    hf = root / "hf"
    cli("consolidate", ckpt, hf, "--format", "hf")
    megatron = torch.load(logits, weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(megatron["tokens"]).logits
    torch.testing.assert_close(got, megatron["logits"][..., :1000], rtol=0, atol=1e-5)
    plain, back = root / "dp1", root / "dp2-again"
    cli("reshard", ckpt, plain, "--dp", "1", "--no-distributed-optimizer")
    cli("reshard", plain, back, "--dp", "2", "--distributed-optimizer")
    report = cli.json("verify", back, "--against", ckpt)
    assert report["ok"], report
    against = next(c for c in report["checks"] if c["name"] == "against")
    assert "108 of 108 tensors" in against["detail"], against
    load = [*args, "--ckpt-format", "torch", "--load"]
    assert_resumes_alike(root, load, own=ckpt, ours=back, world=2)


def test_sgds_momentum_moves_like_adams_state(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """``--optimizer sgd``: the momentum buffers are optimizer state (not weights), resharded
    with their parameters; Megatron-LM resumes from a TP1 -> TP2 -> TP1 round trip with the
    losses it has from its own checkpoint."""
    root = tmp_path_factory.mktemp("megatron-lm-sgd")
    ckpt = root / "legacy"
    args = [*ARGS, "--optimizer", "sgd"]
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*args, *save], steps=SAVED_STEPS)
    info = cli.json("inspect", ckpt)
    assert info["optimizer_bytes"] == info["weight_bytes"]  # one momentum buffer per weight
    tp2, back = root / "tp2", root / "tp1-again"
    cli("reshard", ckpt, tp2, "--tp", "2")
    cli("reshard", tp2, back, "--tp", "1")
    load = ["--no-load-rng", "--load"]
    assert_resumes_alike(root, [*args, *load], own=ckpt, ours=back)


def test_a_tp2_run_of_megatron_lm_reshards_both_ways(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """Megatron-LM at TP2 (its args then carry ``tensor_parallel_num_weight_shards=2``): ckptctl
    reads it, and Megatron-LM resumes from ckptctl's TP2 -> TP1 -> TP2 round trip with the
    losses it has from its own checkpoint, and at TP1 with them to rounding."""
    root = tmp_path_factory.mktemp("megatron-lm-tp2")
    ckpt = root / "legacy"
    tp2 = ["--tensor-model-parallel-size", "2"]
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*ARGS, *tp2, *save], world=2, steps=SAVED_STEPS)
    assert cli.json("inspect", ckpt)["layout"]["tp"] == 2
    tp1, back = root / "tp1", root / "tp2-again"
    cli("reshard", ckpt, tp1, "--tp", "1")
    cli("reshard", tp1, back, "--tp", "2")
    load = ["--no-load-rng", "--load"]
    own = train(root / "own", [*ARGS, *tp2, *load, str(ckpt)], world=2, steps=RESUMED_STEPS)
    ours = train(root / "ours", [*ARGS, *tp2, *load, str(back)], world=2, steps=RESUMED_STEPS)
    assert ours["losses"] == own["losses"]
    at_tp1 = train(root / "at-tp1", [*ARGS, *load, str(tp1)], steps=RESUMED_STEPS)
    torch.testing.assert_close(
        torch.tensor(at_tp1["losses"]), torch.tensor(own["losses"]), rtol=1e-5, atol=0
    )


TP2_DP2 = [*ARGS, "--global-batch-size", "4", "--ckpt-format", "torch_dist"]
TP2_DP2 += ["--tensor-model-parallel-size", "2"]
DISTRIBUTED = ["--use-distributed-optimizer"]
FULLY_RESHARDABLE = ["--dist-ckpt-optim-fully-reshardable"]
SAVE = ["--save-interval", "1000", "--save"]


@pytest.fixture(scope="module")
def distributed_tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One TP2 DP2 fp32 run with the distributed optimizer, saved as ``torch_dist`` in
    Megatron's default form (``dp_reshardable``: raw grad-buffer buckets of that layout) and,
    the same run again, in its ``fully_reshardable`` form."""
    root = tmp_path_factory.mktemp("megatron-lm-distributed")
    buckets, per_parameter = root / "dp_reshardable", root / "fully_reshardable"
    train(root / "a", [*TP2_DP2, *DISTRIBUTED, *SAVE, str(buckets)], world=4, steps=SAVED_STEPS)
    twin = [*TP2_DP2, *DISTRIBUTED, *FULLY_RESHARDABLE, *SAVE, str(per_parameter)]
    train(root / "b", twin, world=4, steps=SAVED_STEPS)
    return {"root": root, "buckets": buckets, "per_parameter": per_parameter}


def test_megatron_lms_default_distributed_optimizer_state_moves(
    distributed_tp2: dict[str, Path], cli
) -> None:
    """At TP2 DP2 in fp32 the run is bit-identical to one without the distributed optimizer,
    so: the buckets read as that run's per-parameter state, bit for bit; and Megatron-LM, loading
    ckptctl's TP1 output without the distributed optimizer, trains on with the losses it has
    when it reshards the other run's checkpoint to TP1 itself."""
    root, buckets = distributed_tp2["root"], distributed_tp2["buckets"]
    plain = root / "plain"
    train(root / "plain-run", [*TP2_DP2, *SAVE, str(plain)], world=4, steps=SAVED_STEPS)
    assert cli.json("verify", buckets, "--against", plain)["ok"]
    tp1 = root / "tp1"
    cli("reshard", buckets, tp1, "--tp", "1", "--no-distributed-optimizer")
    at_tp1 = [*ARGS, "--global-batch-size", "4", "--ckpt-format", "torch_dist", "--load"]
    assert_resumes_alike(root, at_tp1, own=plain, ours=tp1, world=2)


def test_distributed_optimizer_state_reshards_as_megatron_lm_reshards_it(
    distributed_tp2: dict[str, Path], cli
) -> None:
    """The dp_reshardable buckets at TP2 -> TP1 (DP2, the distributed optimizer kept) by
    ckptctl, as buckets again (the source's form) and per parameter (``--optim-sharding
    fully_reshardable``), equal, weights and Adam state bit for bit, what Megatron-LM's own
    load-time resharding makes of the fully_reshardable twin (loaded at TP1 and saved at
    once); and Megatron-LM trains on from either with the losses it has from that twin."""
    root = distributed_tp2["root"]
    tp1 = [*ARGS, "--global-batch-size", "4", "--ckpt-format", "torch_dist", *DISTRIBUTED]
    own = root / "megatron-tp1"
    load_twin = ["--load", str(distributed_tp2["per_parameter"])]
    train(root / "own", [*tp1, *FULLY_RESHARDABLE, *load_twin, *SAVE, str(own)], world=2, steps=0)
    buckets, per_parameter = root / "ckptctl-tp1", root / "ckptctl-tp1-per-parameter"
    cli("reshard", distributed_tp2["buckets"], buckets, "--tp", "1")
    cli(
        "reshard",
        distributed_tp2["buckets"],
        per_parameter,
        "--tp",
        "1",
        "--optim-sharding",
        "fully_reshardable",
    )
    resumed = train(root / "from-twin", [*tp1, *load_twin], world=2, steps=RESUMED_STEPS)
    for ours in (buckets, per_parameter):
        report = cli.json("verify", ours, "--against", own)
        assert report["ok"], report
        against = next(c for c in report["checks"] if c["name"] == "against")
        assert "108 of 108 tensors" in against["detail"], against
        assert "padding rows (1000..1023) equal in 8 tensors" in against["detail"], against
        load = [*tp1, "--load", str(ours)]
        theirs = train(root / f"from-{ours.name}", load, world=2, steps=RESUMED_STEPS)
        assert theirs["losses"] == resumed["losses"], ours.name


def test_a_bf16_run_reshards_as_megatron_lm_reshards_it(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """bf16 weights, fp32 masters (Megatron's mixed-precision optimizer, ``fp32_param`` state)
    in ``torch_dist``: ckptctl's TP2 reshard resumes with exactly the losses of Megatron-LM
    resharding its own checkpoint to TP2 on load."""
    root = tmp_path_factory.mktemp("megatron-lm-bf16")
    ckpt, tp2 = root / "torch_dist", root / "tp2"
    args = [*ARGS, "--bf16", "--ckpt-format", "torch_dist"]
    train(
        root / "first", [*args, "--save", str(ckpt), "--save-interval", "1000"], steps=SAVED_STEPS
    )
    cli("reshard", ckpt, tp2, "--tp", "2")
    at_tp2 = [*args, "--tensor-model-parallel-size", "2", "--load"]
    assert_resumes_alike(root, at_tp2, own=ckpt, ours=tp2, world=2)


def test_a_mixture_of_experts_run_reshards_over_expert_parallelism(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """4 routed experts (top-2) at EP2 (``mp_rank_00_00E`` rank files; the ``allgather`` token
    dispatcher: ``alltoall`` needs CUDA stream events the CPU shims do not answer): EP2 -> EP1
    -> EP2 by ckptctl comes back bit for bit, and Megatron-LM resumes from it with the losses it
    has from its own checkpoint."""
    root = tmp_path_factory.mktemp("megatron-lm-moe")
    ckpt, ep1, back = root / "legacy", root / "ep1", root / "ep2-again"
    args = [
        *ARGS,
        *shlex.split(
            "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 "
            "--moe-token-dispatcher-type allgather --moe-aux-loss-coeff 0 --global-batch-size 4"
        ),
    ]
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*args, *save], world=2, steps=SAVED_STEPS)
    cli("reshard", ckpt, ep1, "--ep", "1")
    cli("reshard", ep1, back, "--ep", "2")
    assert cli.json("verify", back, "--against", ckpt)["ok"]
    load = ["--no-load-rng", "--load"]
    assert_resumes_alike(root, [*args, *load], own=ckpt, ours=back, world=2)


def test_a_mixture_of_experts_runs_default_optimizer_state_moves(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """The same EP2 run with the distributed optimizer saved as ``torch_dist`` in Megatron's
    default form (``dp_reshardable``: a chained optimizer's buckets, the dense one's over DP2,
    the experts' per EP rank) and as its ``fully_reshardable`` twin: the buckets read as the
    twin's per-parameter state bit for bit, EP2 -> EP1 -> EP2 by ckptctl comes back bit for
    bit, and Megatron-LM trains on from that with the losses it has from its own checkpoint."""
    root = tmp_path_factory.mktemp("megatron-lm-moe-distributed")
    buckets, twin = root / "dp_reshardable", root / "fully_reshardable"
    args = [
        *ARGS,
        *shlex.split(
            "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 "
            "--moe-token-dispatcher-type allgather --moe-aux-loss-coeff 0 --global-batch-size 4 "
            "--ckpt-format torch_dist"
        ),
        *DISTRIBUTED,
    ]
    train(root / "a", [*args, *SAVE, str(buckets)], world=2, steps=SAVED_STEPS)
    train(root / "b", [*args, *FULLY_RESHARDABLE, *SAVE, str(twin)], world=2, steps=SAVED_STEPS)
    report = cli.json("verify", buckets, "--against", twin)
    assert report["ok"], report
    against = next(c for c in report["checks"] if c["name"] == "against")
    assert "220 of 220 tensors" in against["detail"], against
    ep1, back = root / "ep1", root / "ep2-again"
    cli("reshard", buckets, ep1, "--ep", "1")
    cli("reshard", ep1, back, "--ep", "2")
    assert cli.json("verify", back, "--against", twin)["ok"]
    assert_resumes_alike(root, [*args, "--load"], own=buckets, ours=back, world=2)


def test_expert_tensor_parallelism_unlike_tp_default_optimizer_state_moves(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """4 experts at EP2 with expert TP 2 over TP 1 (4 ranks: the dense optimizer over DP4, the
    experts' over ETP2 x EP2), the distributed optimizer saved ``dp_reshardable`` and as its
    ``fully_reshardable`` twin. The buckets (the output layer's cut between two DP ranks'
    chunks) read as the twin bit for bit, vocabulary padding rows included; ETP2 EP2 -> ETP1
    EP1 -> ETP2 EP2 by ckptctl comes back bit for bit; ckptctl's ETP1 cut equals Megatron-LM's
    own load-time reshard of the twin, and Megatron-LM trains on from it with that twin's
    losses. (Expert TP over TP > 1 would need sequence parallelism, which the local spec's
    torch norms refuse: expert TP above TP is what runs on the CPU.)"""
    root = tmp_path_factory.mktemp("megatron-lm-etp")
    buckets, twin = root / "dp_reshardable", root / "fully_reshardable"
    args = [
        *ARGS,
        *shlex.split(
            "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 "
            "--moe-token-dispatcher-type allgather --moe-aux-loss-coeff 0 --global-batch-size 8 "
            "--ckpt-format torch_dist"
        ),
        *DISTRIBUTED,
    ]
    at_etp2 = [*args, "--expert-tensor-parallel-size", "2"]
    train(root / "a", [*at_etp2, *SAVE, str(buckets)], world=4, steps=SAVED_STEPS)
    train(root / "b", [*at_etp2, *FULLY_RESHARDABLE, *SAVE, str(twin)], world=4, steps=SAVED_STEPS)
    report = cli.json("verify", buckets, "--against", twin)
    against = next(c for c in report["checks"] if c["name"] == "against")
    assert report["ok"], report
    assert "220 of 220 tensors" in against["detail"], against
    assert "padding rows (1000..1023) equal in 8 tensors" in against["detail"], against
    flat, back = root / "etp1-ep1", root / "etp2-ep2"
    cli("reshard", buckets, flat, "--ep", "1", "--etp", "1")
    cli("reshard", flat, back, "--ep", "2", "--etp", "2")
    assert cli.json("verify", back, "--against", twin)["ok"]

    at_etp1 = [*args, "--expert-tensor-parallel-size", "1"]
    own, ours = root / "megatron-etp1", root / "ckptctl-etp1"
    load_twin = ["--load", str(twin)]
    train(
        root / "own", [*at_etp1, *FULLY_RESHARDABLE, *load_twin, *SAVE, str(own)], world=4, steps=0
    )
    cli("reshard", buckets, ours, "--etp", "1")
    report = cli.json("verify", ours, "--against", own)
    against = next(c for c in report["checks"] if c["name"] == "against")
    assert report["ok"], report
    assert "padding rows (1000..1023) equal in 8 tensors" in against["detail"], against
    resumed = train(root / "from-twin", [*at_etp1, *load_twin], world=4, steps=RESUMED_STEPS)
    theirs = train(
        root / "from-ours", [*at_etp1, "--load", str(ours)], world=4, steps=RESUMED_STEPS
    )
    assert theirs["losses"] == resumed["losses"]


def test_a_qwen3_style_run_becomes_qwen3_and_reshards_as_megatron_lm_reshards_it(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """Qwen3's shape (an RMSNorm over each query and key head, ``--qk-layernorm``, RoPE base
    1e6) saved as ``torch_dist``: its HF model is a ``Qwen3ForCausalLM`` with Megatron's
    logits, and Megatron-LM trains on from ckptctl's TP2 reshard with the losses it has when
    it reshards the checkpoint to TP2 itself."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("megatron-lm-qwen3")
    ckpt, logits = root / "torch_dist", root / "logits.pt"
    args = [*ARGS, "--qk-layernorm", "--rotary-base", "1000000", "--ckpt-format", "torch_dist"]
    train(root / "first", [*args, *SAVE, str(ckpt)], steps=SAVED_STEPS, logits=logits)
    hf = root / "hf"
    cli("consolidate", ckpt, hf, "--format", "hf")
    config = transformers.AutoConfig.from_pretrained(hf)
    assert config.architectures == ["Qwen3ForCausalLM"], config.architectures
    megatron = torch.load(logits, weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(megatron["tokens"]).logits
    torch.testing.assert_close(got, megatron["logits"][..., :1000], rtol=0, atol=1e-5)
    tp2 = root / "tp2"
    cli("reshard", ckpt, tp2, "--tp", "2")
    at_tp2 = [*args, "--tensor-model-parallel-size", "2", "--load"]
    assert_resumes_alike(root, at_tp2, own=ckpt, ours=tp2, world=2)


def test_a_virtual_pipeline_run_reshards_as_megatron_lm_reshards_it(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """PP2 with two virtual stages per rank (interleaved schedule; one layer per model chunk),
    saved as ``torch_dist`` and, the same run again, in the legacy format (``model0``/``model1``
    per rank file): ckptctl's PP1 reshard of each trains on with the losses Megatron-LM has
    when it reshards the ``torch_dist`` checkpoint to PP1 itself."""
    root = tmp_path_factory.mktemp("megatron-lm-vpp")
    args = [*ARGS, "--global-batch-size", "4"]
    vpp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    dist, legacy = root / "torch_dist", root / "legacy"
    train(
        root / "a",
        [*args, *vpp, "--ckpt-format", "torch_dist", *SAVE, str(dist)],
        world=2,
        steps=SAVED_STEPS,
    )
    train(
        root / "b",
        [*args, *vpp, "--ckpt-format", "torch", *SAVE, str(legacy)],
        world=2,
        steps=SAVED_STEPS,
    )
    assert cli.json("inspect", legacy)["layout"]["vpp"] == 2
    assert cli.json("verify", legacy, "--against", dist)["ok"]
    own = train(
        root / "own",
        [*args, "--ckpt-format", "torch_dist", "--load", str(dist)],
        steps=RESUMED_STEPS,
    )
    dist_pp1, legacy_pp1 = root / "torch_dist-pp1", root / "legacy-pp1"
    cli("reshard", dist, dist_pp1, "--pp", "1", "--vpp", "1")
    cli("reshard", legacy, legacy_pp1, "--pp", "1", "--vpp", "1")
    for ours, load in (
        (dist_pp1, ["--ckpt-format", "torch_dist"]),
        (legacy_pp1, ["--ckpt-format", "torch", "--no-load-rng"]),
    ):
        theirs = train(
            root / f"from-{ours.name}", [*args, *load, "--load", str(ours)], steps=RESUMED_STEPS
        )
        assert theirs["losses"] == own["losses"], ours.name


def test_an_fp16_runs_loss_scale_moves_with_it(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """fp16 with dynamic loss scaling (a short growth window, so the scale the checkpoint keeps
    decides the next steps): ckptctl's TP2 reshard, as ``torch_dist`` and as legacy, keeps the
    grad scaler's state (loss scale and its counters), and Megatron-LM trains on from either
    with the losses it has when it reshards the checkpoint to TP2 itself."""
    root = tmp_path_factory.mktemp("megatron-lm-fp16")
    # A first scale of 2^32 (Megatron's default) overflows and skips the few steps run here.
    args = [*ARGS, "--fp16", "--loss-scale-window", "4", "--initial-loss-scale", "4096"]
    ckpt = root / "torch_dist"
    train(root / "a", [*args, "--ckpt-format", "torch_dist", *SAVE, str(ckpt)], steps=SAVED_STEPS)
    tp2 = [*args, "--tensor-model-parallel-size", "2"]
    own = train(
        root / "own",
        [*tp2, "--ckpt-format", "torch_dist", "--load", str(ckpt)],
        world=2,
        steps=RESUMED_STEPS,
    )
    dist, legacy = root / "tp2", root / "tp2-legacy"
    cli("reshard", ckpt, dist, "--tp", "2")
    cli("reshard", ckpt, legacy, "--tp", "2", "--format", "megatron")
    common = dist / "iter_0000003" / "common.pt"
    rank_file = legacy / "iter_0000003" / "mp_rank_01" / "model_optim_rng.pt"
    source = _grad_scaler(ckpt / "iter_0000003" / "common.pt", common_state=True)
    assert source["growth_tracker"] == SAVED_STEPS, source
    assert _grad_scaler(common) == source
    assert _grad_scaler(rank_file) == source
    for ours, load in ((dist, ["--ckpt-format", "torch_dist"]), (legacy, ["--no-load-rng"])):
        theirs = train(
            root / f"from-{ours.name}",
            [*tp2, *load, "--load", str(ours)],
            world=2,
            steps=RESUMED_STEPS,
        )
        assert theirs["losses"] == own["losses"], ours.name


def _grad_scaler(path: Path, common_state: bool = False) -> dict[str, Any]:
    """The grad scaler's state a Megatron file keeps, read as ckptctl reads it (the file's
    args name enums of Megatron-LM 0.19 that this environment's megatron-core lacks)."""
    from ckptctl.formats.torchsave.archive import TorchZipReader

    if common_state and not path.exists():  # 0.19 keeps the common state inside the DCP files
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(path.parent)).read_metadata()
        info = next(i for k, i in metadata.storage_data.items() if k.fqn.startswith("common_state"))
        with open(path.parent / info.relative_path, "rb") as f:
            f.seek(info.offset)
            record = io.BytesIO(f.read(info.length))
        reader = TorchZipReader(record, str(path))
        tree = reader.tree[0]
    else:
        with open(path, "rb") as f:
            reader = TorchZipReader(io.BytesIO(f.read()), str(path))
        tree = reader.tree
    scaler = dict(tree["optimizer"]["grad_scaler"])
    scaler["scale"] = reader.read_number(scaler["scale"])
    return scaler


def test_an_fp16_runs_default_distributed_optimizer_state_moves(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """fp16 with the distributed optimizer, saved as Megatron's default dp_reshardable buckets
    (whose grad buffers reduce in fp16, and whose grad scaler is kept beside them): TP1 -> TP2
    -> TP1 by ckptctl, as buckets each time, comes back bit for bit with the grad scaler, and
    Megatron-LM trains on from it with the losses of its own checkpoint."""
    root = tmp_path_factory.mktemp("megatron-lm-fp16-distributed")
    args = [*ARGS, "--fp16", "--loss-scale-window", "4", "--initial-loss-scale", "4096"]
    args += ["--global-batch-size", "4"]
    args += ["--ckpt-format", "torch_dist", *DISTRIBUTED]
    ckpt, tp2, back = root / "dp_reshardable", root / "tp2", root / "tp1-again"
    train(root / "a", [*args, *SAVE, str(ckpt)], world=2, steps=SAVED_STEPS)
    cli("reshard", ckpt, tp2, "--tp", "2")
    cli("reshard", tp2, back, "--tp", "1")
    report = cli.json("verify", back, "--against", ckpt)
    assert report["ok"], report
    assert not any("grad_scaler" in w for w in cli.json("inspect", back).get("warnings", []))
    assert_resumes_alike(root, [*args, "--load"], own=ckpt, ours=back, world=2)
