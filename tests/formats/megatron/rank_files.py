"""Legacy Megatron checkpoints compared rank file by rank file (the megatron-core oracles' tests):
every model tensor and optimizer value, keys in order."""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import torch

TRUE_VOCAB = 1000
"""The oracles' true vocabulary (``tests/oracles/mcore_cpu.py``)."""


def flat(obj: Any, path: str = "") -> dict[str, Any]:
    """Every tensor and plain value under ``obj``, by key path."""
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in flat(value, f"{path}/{key}").items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, value in enumerate(obj) for k, v in flat(value, f"{path}/{i}").items()}
    return {path: obj}


class _Unknown:
    """Stands in for a class of the saving release this environment lacks (Megatron-LM 0.19's
    enums in ``args``, read under megatron-core 0.16.1): ``args`` is not compared here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (AttributeError, ModuleNotFoundError):
            return type(name, (_Unknown,), {})


_TOLERANT = types.SimpleNamespace(Unpickler=_Unpickler, __name__="pickle", load=pickle.load)


def rank_files(root: Path) -> dict[str, dict[str, Any]]:
    """Per rank directory: model tensors (extra state aside), optimizer tensors and groups."""
    out = {}
    for path in sorted(root.rglob("model_optim_rng.pt")):
        state = torch.load(path, weights_only=False, pickle_module=_TOLERANT)
        model = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
        out[path.parent.name] = flat({"model": model, "optimizer": state["optimizer"]})
    return out


def optimizer_tensors(root: Path) -> list[torch.Tensor]:
    """Every tensor of every rank file's optimizer state (Adam's moments, found by value, not
    by the parameter index that keys them)."""
    return [
        value
        for files in rank_files(root).values()
        for key, value in files.items()
        if key.startswith("/optimizer/") and isinstance(value, torch.Tensor) and value.dim() > 0
    ]


def holds(tensors: list[torch.Tensor], want: torch.Tensor) -> bool:
    """Whether one of ``tensors`` equals ``want``, bit for bit."""
    return any(t.shape == want.shape and torch.equal(t, want) for t in tensors)


_VOCAB_TENSORS = ("/model/embedding.word_embeddings.weight", "/model/output_layer.weight")


def assert_same_rank_files(mine: Path, theirs: Path) -> None:
    """Same rank files, keys in the same order, every value equal; a tensor's padded
    vocabulary rows aside (megatron-core fills them with initial values, ckptctl with zeros:
    they are never a token)."""
    a, b = rank_files(mine), rank_files(theirs)
    assert a.keys() == b.keys()
    for rank, values in b.items():
        assert list(a[rank]) == list(values), rank
        # (a vocabulary tensor's rows: the embedding's, or on a last stage the output layer's)
        vocab = [v for k, v in values.items() if k.endswith(_VOCAB_TENSORS)]
        rows = vocab[0].shape[0] if vocab else -1
        tp_rank = int(rank.split("_")[2])
        true_rows = max(0, min(rows, TRUE_VOCAB - tp_rank * rows))
        for key, want in values.items():
            got = a[rank][key]
            if isinstance(want, torch.Tensor):
                if want.dim() and want.shape[0] == rows:
                    got, want = got[:true_rows], want[:true_rows]
                assert got.dtype == want.dtype and torch.equal(got, want), (rank, key)
            elif not key.endswith("/params"):
                assert got == want, (rank, key)


def assert_pp2_detour_loses_nothing(src: Path, tmp_path: Path, cli: Any) -> None:
    """``src`` resharded to legacy TP1 PP2 and back to TP2 holds the rank files of its direct
    conversion to legacy TP2, Adam state included."""
    pp2, back, direct = tmp_path / "pp2", tmp_path / "back", tmp_path / "direct"
    cli("reshard", src, pp2, "--tp", "1", "--pp", "2", "--format", "megatron")
    cli("reshard", pp2, back, "--tp", "2", "--pp", "1", "--format", "megatron")
    cli("reshard", src, direct, "--tp", "2", "--pp", "1", "--format", "megatron")
    assert cli.json("inspect", direct)["has_optimizer"]
    assert_same_rank_files(back, direct)
