"""DeepSpeed checkpoints to other training stacks' formats (issue 16), judged by the stacks
themselves: a torch state dict that torch's ``set_state_dict`` loads into a transformers model
and its AdamW; universal checkpoints that DeepSpeed engines of another ZeRO stage and DP size
resume from (also one made from a Megatron checkpoint); Megatron-Core names with the Adam
state. The DeepSpeed runs are ``tests/deepspeed_runs.py``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is the oracle here")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from tests import deepspeed_runs as runs  # noqa: E402  (after the skips)

pytestmark = pytest.mark.oracle
written = runs.written  # the DeepSpeed runs, written once per session


@pytest.mark.parametrize("run", ["stage2-dp2", "stage3-bf16-dp3"])
def test_torch_state_dict_is_what_torch_loads(
    written: dict[str, Path], run: str, tmp_path: Path, cli
) -> None:
    """consolidate --format torch: HF-named weights and Adam state that torch's own
    set_state_dict puts into a transformers model and its AdamW, equal to DeepSpeed's."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    ckpt = written[run]
    cli("consolidate", ckpt, tmp_path / "t", "--format", "torch")
    state = torch.load(tmp_path / "t" / "state_dict.pt", weights_only=True)
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(ckpt))
    model.get_parameter(runs.FROZEN).requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in trained if p.dim() > 1]},
            {"params": [p for p in trained if p.dim() <= 1]},
        ],
        lr=5e-4,
    )
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    theirs = torch.load(ckpt.parent / f"{run}.fp32.pt", weights_only=True)
    named = dict(model.named_parameters())
    for name, param in named.items():
        assert torch.equal(param.detach().float(), theirs[name]), name
        if name == runs.FROZEN:
            assert param not in optimizer.state
            continue
        held = optimizer.state[param]
        assert float(held["step"]) == 2.0, name
        for moment in ("exp_avg", "exp_avg_sq"):
            want = runs.universal_state(ckpt, name, moment)
            assert torch.equal(held[moment], want.view(held[moment].shape)), (moment, name)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 1e-3]  # restored, not 5e-4
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize(
    ("run", "stage", "dp", "dtype"),
    [
        ("stage3-dp2", "2", "3", "fp32"),
        ("stage2-bf16-dp2", "3", "2", "bf16"),
        ("bf16-optimizer-dp2", "1", "3", "bf16"),
    ],
)
def test_universal_checkpoint_resumes_in_deepspeed_at_another_dp(
    written: dict[str, Path], run: str, stage: str, dp: str, dtype: str, tmp_path: Path, cli
) -> None:
    """ckptctl's universal checkpoint, loaded by a DeepSpeed engine of another ZeRO stage and
    DP size with load_universal_checkpoint: the engine's fp32 masters and Adam moments are
    what DeepSpeed's own ds_to_universal extracts, its step and group settings the source's."""
    ckpt = written[run]
    universal = tmp_path / "universal"
    cli("consolidate", ckpt, universal, "--format", "deepspeed-universal")
    assert (universal / "latest_universal").read_text().strip() == "global_step2_universal"
    assert cli.json("verify", universal, "--against", ckpt)["ok"]
    held = runs.load_universal(universal, tmp_path / "held.pt", stage, dp, dtype)
    assert len(held["params"]) == 19  # every trained parameter (lm_head is tied)
    for name, states in held["params"].items():
        want = runs.universal_state(ckpt, name, "fp32")
        assert torch.equal(states["fp32"], want.view(states["fp32"].shape)), name
        for moment in ("exp_avg", "exp_avg_sq"):
            want = runs.universal_state(ckpt, name, moment)
            assert torch.equal(states[moment], want.view(states[moment].shape)), (moment, name)
    assert held["steps"] and set(held["steps"]) == {2.0}
    assert [g["lr"] for g in held["groups"]] == [1e-3, 1e-3]  # the engine was built with 5e-4
    decays = [g["weight_decay"] for g in held["groups"]]
    # DeepSpeed 0.19.8's ZeRO 3 universal loader gives every group the first group's settings.
    assert decays == ([0.1, 0.1] if stage == "3" else [0.1, 0.0])


def test_universal_checkpoint_from_megatron(tmp_path: Path, cli) -> None:
    """A Megatron checkpoint (TP2, distributed optimizer over DP2) becomes a universal
    checkpoint DeepSpeed resumes from: the engine holds the generator's fp32 weights, Adam
    moments and step."""
    from ckptctl import synth

    config = synth.tiny_llama_config(
        hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, num_layers=2
    )
    model = synth.make_model(config, seed=3)
    states = synth.adam_step(model, seed=4)
    src = tmp_path / "megatron"
    synth.write_megatron(model, states, str(src), tp=2, distributed_optimizer=True, dp=2)
    universal = tmp_path / "universal"
    cli("consolidate", src, universal, "--format", "deepspeed-universal")
    assert cli.json("verify", universal, "--against", src)["ok"]
    held = runs.load_universal(universal, tmp_path / "held.pt", "2", "2", "fp32")
    weights = dict(model.named_parameters())
    assert len(held["params"]) == len(weights) - 1  # all but the loader's frozen weight
    for name, got in held["params"].items():
        assert torch.equal(got["fp32"], weights[name].detach()), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[moment], states[name][moment]), (moment, name)
    assert set(held["steps"]) == {float(next(iter(states.values()))["step"])}


def test_megatron_target_continues_the_deepspeed_run(
    written: dict[str, Path], tmp_path: Path, cli
) -> None:
    """consolidate --format megatron: fp32 masters and Adam moments on Megatron-Core names
    (fused QKV, SwiGLU fc1 halves), bit for bit; as bf16 weights (--dtype bf16) with the masters
    in fp32_from_fp16_params, the weights are DeepSpeed's own bf16 module; a DeepSpeed run with
    frozen parameters is refused (Megatron's optimizer holds every parameter)."""
    ckpt = written["stage2-bf16-dp2-all"]
    cli("consolidate", ckpt, tmp_path / "fp32", "--format", "megatron")
    report = cli.json("verify", tmp_path / "fp32", "--against", ckpt)
    assert sum(t["name"].startswith("exp_avg") for t in report["tensors"]) == 28
    cli("consolidate", tmp_path / "fp32", tmp_path / "hf", "--format", "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    reference = transformers.LlamaForCausalLM(model.config)
    reference.load_state_dict(torch.load(ckpt.parent / "stage2-bf16-dp2-all.fp32.pt"))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    cli("consolidate", ckpt, tmp_path / "bf16", "--format", "megatron", "--dtype", "bf16")
    rank = torch.load(
        tmp_path / "bf16" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False
    )
    assert len(rank["optimizer"]["fp32_from_fp16_params"][0]) > 0
    cli("consolidate", tmp_path / "bf16", tmp_path / "hf16", "--format", "hf")
    ours = safetensors.load_file(tmp_path / "hf16" / "model.safetensors")
    module = torch.load(next(ckpt.glob("*/mp_rank_00_model_states.pt")), weights_only=False)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, module["module"][name]), name
    masters, weights = runs.by_hf_name(tmp_path / "bf16", "fp32_param"), runs.by_hf_name(ckpt, "")
    assert masters.keys() == weights.keys()
    for name, master in masters.items():
        assert torch.equal(master, weights[name]), name

    result = cli(
        "consolidate", written["stage2-dp2"], tmp_path / "no", "--format", "megatron", code=2
    )
    assert "frozen parameters" in result.stderr and "--format torch" in result.stderr


def test_universal_fp32_files_hold_megatrons_masters_not_its_bf16_weights(
    tmp_path: Path, cli
) -> None:
    """A bf16 Megatron checkpoint keeps fp32 masters beside its weights: the universal
    checkpoint's fp32.pt files are those masters, not the bf16 weights widened."""
    from ckptctl import synth

    model = synth.make_model(synth.tiny_llama_config(), seed=5)
    states = synth.adam_step(model, seed=6)
    src = tmp_path / "megatron"
    synth.write_megatron(model, states, str(src), tp=2, params_dtype=torch.bfloat16)
    cli("consolidate", src, tmp_path / "u", "--format", "deepspeed-universal")
    zero = tmp_path / "u" / "global_step1_universal" / "zero"
    widened = 0
    for name, param in model.named_parameters():
        held = torch.load(zero / name / "fp32.pt", weights_only=True)["param"]
        assert held.dtype == torch.float32 and torch.equal(held, param.detach()), name
        widened += not torch.equal(held, held.bfloat16().float())
    assert widened > 0  # the masters carry bits the bf16 weights do not
