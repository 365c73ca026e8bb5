"""Canonical tensors made when asked: a Megatron checkpoint larger than memory, written rank
file by rank file (``write_megatron_canonical``). Weights and Adam moments are seeded random
numbers, the same for every rank that holds a part of a tensor; no model is built and no Adam
step taken (a bench of moving bytes needs neither; the tests' small checkpoints come from the
real step in ``ckptctl.synth.model``). Imports only torch and transformers, like the rest of
the oracle."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping

import torch
from transformers import LlamaConfig

from ckptctl.synth.model import EMBEDDING, FINAL_NORM, OUTPUT, config_int

_KINDS = ("fp32_param", "exp_avg", "exp_avg_sq")


def canonical_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor's full shape (vocabulary unpadded), in model order."""
    h = config_int(config, "hidden_size")
    ffn = config_int(config, "intermediate_size")
    nq = config_int(config, "num_attention_heads")
    ng = config_int(config, "num_key_value_heads")
    d = config_int(config, "head_dim")
    vocab = config_int(config, "vocab_size")
    shapes: dict[str, tuple[int, ...]] = {EMBEDDING: (vocab, h)}
    for i in range(config_int(config, "num_hidden_layers")):
        layer = f"decoder.layers.{i}."
        shapes[layer + "self_attention.linear_proj.weight"] = (h, nq * d)
        shapes[layer + "self_attention.linear_qkv.layer_norm_weight"] = (h,)
        shapes[layer + "self_attention.linear_qkv.weight"] = ((nq + 2 * ng) * d, h)
        shapes[layer + "mlp.linear_fc1.layer_norm_weight"] = (h,)
        shapes[layer + "mlp.linear_fc1.weight"] = (2 * ffn, h)
        shapes[layer + "mlp.linear_fc2.weight"] = (h, ffn)
    shapes[FINAL_NORM] = (h,)
    if not config.tie_word_embeddings:
        shapes[OUTPUT] = (vocab, h)
    return shapes


def _made(name: str, kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The tensor of ``kind`` for canonical ``name``: the same numbers at every call."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{kind}/{name}".encode()))
    values = torch.randn(shape, generator=generator)
    if kind == "exp_avg_sq":
        return values.abs_().mul_(1e-6)
    if kind == "exp_avg":
        return values.mul_(1e-3)
    if len(shape) == 1:  # norms near one, as trained
        return values.mul_(0.02).add_(1.0)
    return values.mul_(0.02)


class _States(Mapping[str, torch.Tensor]):
    """One tensor's Adam state: the fp32 master (equal to the weight), moments and step."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int) -> None:
        self.name, self.shape, self.seed = name, shape, seed

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "step":
            return torch.tensor(1.0)
        if key not in _KINDS:
            raise KeyError(key)
        return _made(self.name, key, self.shape, self.seed)

    def __iter__(self) -> Iterator[str]:
        return iter((*_KINDS, "step"))

    def __len__(self) -> int:
        return len(_KINDS) + 1


class MadeWeights(Mapping[str, torch.Tensor]):
    """Canonical weights, each made when looked up."""

    def __init__(self, config: LlamaConfig, seed: int = 0) -> None:
        self.shapes, self.seed = canonical_shapes(config), seed

    def __getitem__(self, name: str) -> torch.Tensor:
        return _made(name, "fp32_param", self.shapes[name], self.seed)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class MadeStates(Mapping[str, Mapping[str, torch.Tensor]]):
    """Canonical Adam states, each tensor made when looked up."""

    def __init__(self, config: LlamaConfig, seed: int = 0) -> None:
        self.shapes, self.seed = canonical_shapes(config), seed

    def __getitem__(self, name: str) -> Mapping[str, torch.Tensor]:
        return _States(name, self.shapes[name], self.seed)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def parameter_count(config: LlamaConfig) -> int:
    total = 0
    for shape in canonical_shapes(config).values():
        n = 1
        for size in shape:
            n *= size
        total += n
    return total
