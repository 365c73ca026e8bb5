"""What the verl FSDP tests share: where an oracle run's actor files and truth are, and the
judges (transformers' logits, torch loading the files as verl does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.oracle_runner import run_oracle

ORACLE = "verl_fsdp_writer.py"


def actor(run: Path) -> Path:
    return run / "global_step_1" / "actor"


def truth(run: Path) -> dict[str, Any]:
    return torch.load(run / "truth.pt", weights_only=False)


def loaded(directory: Path) -> Any:
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(directory))
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")


def check_against_truth(run: Path, hf: Path, exact: bool = True) -> None:
    """The weights bit for bit; the logits too, or (``exact=False``: GPT-OSS's experts, whose
    kernels sum in another order sharded than whole) to float32 rounding."""
    trained = truth(run)
    model = loaded(hf)
    state = model.state_dict()
    for name, want in trained["model"].items():
        assert torch.equal(state[name], want), name
    with torch.no_grad():
        logits = model(input_ids=trained["input_ids"]).logits
    if exact:
        assert torch.equal(logits, trained["logits"])
    torch.testing.assert_close(logits, trained["logits"], rtol=1e-5, atol=1e-6)


def resumed(directory: Path, world: int, tmp_path: Path, shards: int = 0) -> dict[str, Any]:
    """What FSDP2 at ``world`` ranks (HSDP: of ``shards``-rank shard groups) holds after
    loading the actor files in ``directory`` as verl loads them."""
    out = tmp_path / f"loaded{world}-{shards}.pt"
    run_oracle("verl_fsdp_loader.py", "qwen3", directory, world, out, shards, timeout=300)
    return torch.load(out, weights_only=False)


def assert_resumed(truth: dict[str, Any], got: dict[str, Any]) -> None:
    """The loaded weights and Adam state are the trained ones bit for bit; a step was taken."""
    for name, want in truth["model"].items():
        assert torch.equal(got["model"][name], want), name
    assert got["optim"].keys() == truth["optim"].keys()
    for name, states in truth["optim"].items():
        assert states.keys() == got["optim"][name].keys()
        for kind, want in states.items():
            assert torch.equal(got["optim"][name][kind], want), (name, kind)
    assert got["scheduler"]["last_epoch"] == 1 and got["loss"] > 0


def values(directory: Path) -> dict[tuple[str, ...], Any]:
    """Every value of every rank file, a DTensor as its local tensor and placements."""
    out: dict[tuple[str, ...], Any] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, (*path, str(key)))
        elif hasattr(node, "to_local"):
            out[path] = (node.to_local(), tuple(node.placements), tuple(node.shape))
        else:
            out[path] = node

    for file in sorted(directory.glob("*_world_size_*.pt")):
        walk(torch.load(file, weights_only=False), (file.name,))
    return out
