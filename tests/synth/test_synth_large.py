"""The generator of the larger-than-memory bench (``ckptctl.synth.large``) writes a Megatron
checkpoint that ckptctl reads back to the very numbers it made: what ``bench/bench_large.py``
times is a real conversion, not the moving of unreadable bytes."""

from __future__ import annotations

from pathlib import Path

import torch

from ckptctl import synth
from ckptctl.synth.large import MadeStates, MadeWeights, canonical_shapes
from ckptctl.synth.megatron import write_megatron_canonical
from tests.conftest import Cli


def test_a_made_checkpoint_resharded_to_one_rank_holds_the_made_tensors(
    tmp_path: Path, cli: Cli
) -> None:
    config = synth.tiny_llama_config(vocab_size=300, hidden_size=64, num_layers=4)
    src, out = tmp_path / "src", tmp_path / "tp1"
    weights, states = MadeWeights(config, seed=3), MadeStates(config, seed=3)
    write_megatron_canonical(
        config, weights, states, str(src), tp=2, pp=2, params_dtype=torch.bfloat16
    )
    cli("reshard", src, out, "--tp", "1", "--pp", "1")

    saved = torch.load(
        out / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False
    )
    model, optimizer = saved["model"], saved["optimizer"]
    masters = [t for group in optimizer["fp32_from_fp16_params"] for t in group]
    moments = optimizer["optimizer"]["state"]
    compared = 0
    for name, shape in canonical_shapes(config).items():
        rows = shape[0]
        assert torch.equal(model[name][:rows], weights[name].to(torch.bfloat16)), name
        compared += 1
    assert compared == len(canonical_shapes(config)) == len(masters) == len(moments)
    # Every master and moment is one of the made ones, cut to the unpadded vocabulary.
    made = {
        kind: [states[name][kind] for name in canonical_shapes(config)]
        for kind in ("fp32_param", "exp_avg", "exp_avg_sq")
    }
    for i, master in enumerate(masters):
        assert any(torch.equal(master[: m.shape[0]], m) for m in made["fp32_param"]), i
    for i, state in moments.items():
        assert any(torch.equal(state["exp_avg"][: m.shape[0]], m) for m in made["exp_avg"]), i
        assert any(torch.equal(state["exp_avg_sq"][: m.shape[0]], m) for m in made["exp_avg_sq"]), i
