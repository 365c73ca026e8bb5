"""Gated delta net layers and gated attention in the model description (issue 56): the layer
pattern both ways with Megatron's ``linear_attention_freq``, the TP cut of the fused parts, the
parameters per layer kind, and what is refused by name. megatron-core's own modules judge the
whole in ``tests/formats/megatron/test_oracle_gdn.py``."""

from __future__ import annotations

import argparse
import re

import pytest
from pydantic import ValidationError

from ckptctl.errors import LayoutError
from ckptctl.formats.megatron_common.args import args_from_spec, spec_from_args
from ckptctl.model.catalog import parameters
from ckptctl.model.geometry import Split, shard_shape_and_pieces
from ckptctl.model.layout import ModelSpec
from ckptctl.model.linear_attention import (
    GatedDeltaNetSpec,
    freq_from_pattern,
    pattern_from_freq,
)

GDN = GatedDeltaNetSpec(
    num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8, attention_layers=(3,)
)


def _spec(**changes: object) -> ModelSpec:
    fields: dict[str, object] = dict(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        vocab_size=1000,
        attention_output_gate=True,
        linear_attention=GDN,
    )
    fields.update(changes)
    return ModelSpec.model_validate(fields)


def test_parts_are_cut_each_on_its_own() -> None:
    """A rank's shard is its slice of every part in turn (megatron-core's ``in_proj``)."""
    parts = (4, 4, 8, 8, 2, 2)
    local, pieces = shard_shape_and_pieces(Split.PARTS, (28, 3), 2, 1, parts=parts)
    assert local == (14, 3)
    assert [(p.local[0], p.canonical[0], p.sizes[0]) for p in pieces] == [
        (0, 2, 2),
        (2, 6, 2),
        (4, 12, 4),
        (8, 20, 4),
        (12, 25, 1),
        (13, 27, 1),
    ]
    with pytest.raises(ValueError, match="does not divide the parts"):
        shard_shape_and_pieces(Split.PARTS, (28, 3), 4, 0, parts=parts)


@pytest.mark.parametrize(
    ("freq", "attention"),
    [(4, (3, 7)), (2, (1, 3, 5, 7)), (1, tuple(range(8))), ([1, 0, 1, 1, 0, 1, 1, 0], (1, 4, 7))],
)
def test_megatrons_layer_pattern_both_ways(freq: object, attention: tuple[int, ...]) -> None:
    assert pattern_from_freq(freq, 8) == attention
    if attention != tuple(range(8)):  # (freq 1: no linear layer, no linear_attention)
        spec = _spec(
            num_layers=8, linear_attention=GDN.model_copy(update={"attention_layers": attention})
        )
        assert pattern_from_freq(freq_from_pattern(spec), 8) == attention
    for wrong in (0, [1, 0], [2] * 8, True, "4"):
        assert pattern_from_freq(wrong, 8) is None


def test_each_layer_kind_has_its_own_parameters() -> None:
    by_name = {p.name: p for p in parameters(_spec())}
    linear = "decoder.layers.0.self_attention."
    assert by_name[linear + "in_proj.weight"].shape == (2 * 32 + 2 * 32 + 2 * 4, 64)
    assert by_name[linear + "in_proj.weight"].parts == (32, 32, 32, 32, 4, 4)
    assert by_name[linear + "conv1d.weight"].shape == (96, 1, 4)
    assert by_name[linear + "conv1d.weight"].parts == (32, 32, 32)
    assert by_name[linear + "A_log"].split is Split.COLUMN
    assert by_name[linear + "out_norm.weight"].split is Split.REPLICATED
    assert linear + "linear_qkv.weight" not in by_name
    # gated attention: a gate per query head after each group's queries
    qkv = by_name["decoder.layers.3.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((4 + 4 + 2 * 2) * 16, 64)
    assert "decoder.layers.3.self_attention.in_proj.weight" not in by_name


def test_megatron_args_carry_it_both_ways() -> None:
    spec = _spec()
    args = args_from_spec(spec)
    assert args.experimental_attention_variant == "gated_delta_net"
    assert args.linear_attention_freq == 4
    assert args.attention_output_gate is True
    assert args.linear_num_value_heads == 4
    assert spec_from_args(args) == spec
    irregular = _spec(linear_attention=GDN.model_copy(update={"attention_layers": (1, 3)}))
    assert args_from_spec(irregular).linear_attention_freq == 2
    odd = _spec(linear_attention=GDN.model_copy(update={"attention_layers": (0, 3)}))
    assert args_from_spec(odd).linear_attention_freq == [0, 1, 1, 0]
    assert spec_from_args(args_from_spec(odd)) == odd


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"experimental_attention_variant": "dsa"}, "experimental_attention_variant='dsa'"),
        ({"linear_attention_freq": [1, 0]}, "args.linear_attention_freq=[1, 0]"),
        ({"linear_num_key_heads": 3}, "num_key_heads=3 does not divide num_value_heads=4"),
        ({"attention_output_gate": "yes"}, "args.attention_output_gate='yes'"),
    ],
)
def test_what_it_cannot_carry_is_refused_by_name(changes: dict[str, object], message: str) -> None:
    args = argparse.Namespace(**vars(args_from_spec(_spec())))
    for name, value in changes.items():
        setattr(args, name, value)
    with pytest.raises((LayoutError, ValidationError), match=re.escape(message)):
        spec_from_args(args)


def test_inconsistent_descriptions_are_refused() -> None:
    with pytest.raises(ValidationError, match=re.escape("attention_layers [5] are not layers")):
        _spec(linear_attention=GDN.model_copy(update={"attention_layers": (5,)}))
    with pytest.raises(ValidationError, match="linear attention on no layer"):
        _spec(linear_attention=GDN.model_copy(update={"attention_layers": (0, 1, 2, 3)}))
    with pytest.raises(ValidationError, match="need RMSNorm"):
        _spec(normalization="LayerNorm")
