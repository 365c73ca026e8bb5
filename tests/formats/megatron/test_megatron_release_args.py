"""Megatron ``args`` judged by value (issue 52): a field at a default of some Megatron-LM
release passes, a field that changes the model is refused by name, and every field the table
(made from Megatron-LM's own parsers, r0.12 to 0.19.2) knows is classified. Pure: no
checkpoint, no Megatron-LM import."""

from __future__ import annotations

import argparse
import pickle
import signal
from typing import Any

import pytest

from ckptctl.errors import LayoutError
from ckptctl.formats.megatron_common import args_fields, release_args
from ckptctl.formats.megatron_common.args import check_fields
from ckptctl.formats.torchsave.unpickle import Stub, restricted_loads
from ckptctl.model.dtypes import DTYPES

CLASSES: frozenset[str] = (
    args_fields.MAPPED
    | args_fields.HARMLESS
    | frozenset(args_fields.PLAIN_VALUES)
    | frozenset(args_fields.RELATED_VALUES)
    | args_fields.MOE_FIELDS
    | args_fields.MLA_FIELDS
    | args_fields.VARIANT_FIELDS
    | args_fields.MTP_FIELDS
    | args_fields.MUP_FIELDS
)


def _python(default: Any) -> Any:
    """A table value as the checkpoint's unpickled ``args`` hold it."""
    if isinstance(default, dict) and "torch.dtype" in default:
        return DTYPES[default["torch.dtype"]]
    if isinstance(default, dict) and "enum" in default:
        module, _, name = default["enum"].rpartition(".")
        return restricted_loads(_enum_pickle(module, name, default["value"]), "test")
    return default


def _enum_pickle(module: str, name: str, value: int) -> bytes:
    """The bytes ``pickle`` writes for ``module.name(value)`` (an enum member): GLOBAL, the
    value, TUPLE1, REDUCE."""
    argument = pickle.dumps(value, 2)[2:-1]  # without the protocol header and STOP
    return b"\x80\x02c%s\n%s\n%s\x85R." % (module.encode(), name.encode(), argument)


def test_the_table_covers_the_releases_users_hold() -> None:
    names = release_args.releases()
    assert names[0] == "core_r0.12.0" and any("0.19.2" in name for name in names)
    assert len(release_args.parser_fields()) > 800


def test_every_field_of_every_release_is_classified() -> None:
    """A field no class names would be judged by the table alone; derived ones (set by
    ``validate_args`` from the model) never may."""
    assert release_args.derived_names() <= CLASSES
    assert not (release_args.parser_fields() - CLASSES)


@pytest.mark.parametrize(
    "name", sorted(set(args_fields.PLAIN_VALUES) & release_args.parser_fields())
)
def test_every_release_default_of_a_plain_field_passes(name: str) -> None:
    for default in release_args._table()["values"][name]:
        check_fields(argparse.Namespace(**{name: _python(default)}))


def test_the_defaults_of_a_release_pass_together() -> None:
    """What Megatron-LM's parser gives a model nobody configured: nothing to refuse."""
    fields = {
        name: _python(defaults[0])
        for name, defaults in release_args._table()["values"].items()
        if not release_args.derived(name)
    }
    check_fields(argparse.Namespace(**fields))


def test_a_math_field_away_from_its_plain_value_is_refused_by_name() -> None:
    with pytest.raises(LayoutError) as refused:
        check_fields(argparse.Namespace(apply_residual_connection_post_layernorm=True))
    assert "args.apply_residual_connection_post_layernorm=True: not supported yet" in str(
        refused.value
    )


def test_a_switched_off_feature_keeps_its_fields_dormant_until_switched_on() -> None:
    mla = argparse.Namespace(mla_down_proj_fusion=True, multi_latent_attention=False)
    check_fields(mla)
    mla.multi_latent_attention = True  # read now, and its fused down projections are not
    with pytest.raises(LayoutError, match="mla_down_proj_fusion"):
        check_fields(mla)


def test_a_field_no_release_knows_passes_only_when_trusted() -> None:
    odd = argparse.Namespace(attention_sink_tokens=4)
    with pytest.raises(LayoutError) as refused:
        check_fields(odd)
    assert "args.attention_sink_tokens=4: unknown to ckptctl" in str(refused.value)
    assert "--trust-field" in str(refused.value)
    check_fields(odd, trusted=frozenset({"attention_sink_tokens"}))


def test_a_parser_field_is_judged_by_the_value_some_release_gives_it() -> None:
    field = next(
        n
        for n, defaults in release_args._table()["values"].items()
        if not release_args.derived(n) and defaults == [None]
    )
    assert release_args.at_default(field, None)
    assert not release_args.at_default(field, 3)
    assert not release_args.at_default("no_such_field_anywhere", None)
    for derived in release_args.derived_names():
        assert not release_args.at_default(derived, None)


def test_many_unknown_fields_make_one_line_that_counts_the_rest() -> None:
    odd = argparse.Namespace(**{f"made_up_{i}": i + 1 for i in range(9)})
    with pytest.raises(LayoutError) as refused:
        check_fields(odd)
    message = str(refused.value)
    assert "\n" not in message and "and 5 more" in message and "made_up_0=1" in message


def test_a_long_value_is_shortened_in_the_refusal() -> None:
    with pytest.raises(LayoutError) as refused:
        check_fields(argparse.Namespace(made_up=list(range(1000))))
    assert len(str(refused.value)) < 400


def test_the_exit_signal_megatron_keeps_in_args_loads_as_an_inert_stub() -> None:
    loaded = restricted_loads(pickle.dumps(argparse.Namespace(exit_signal=signal.SIGTERM)), "t")
    assert isinstance(loaded.exit_signal, Stub)
    assert release_args.at_default("exit_signal", loaded.exit_signal)
    check_fields(loaded)


@pytest.mark.parametrize(
    ("value", "default", "equal"),
    [
        (True, 1, False),
        (1, True, False),
        (1, 1.0, True),
        ("1", 1, False),
        ([1, 2], [1, 2], True),
        ([1, 2], [1, 2, 3], False),
        ({"enum": "m.E", "value": 5}, 5, True),
        ({"enum": "m.E", "value": 5}, {"enum": "m.E", "value": 5}, True),
        ({"enum": "m.E", "value": 5}, {"enum": "m.F", "value": 5}, False),
        (None, 0, False),
        ({"repr": "object"}, None, False),
    ],
)
def test_values_compare_as_megatron_means_them(value: Any, default: Any, equal: bool) -> None:
    assert release_args.same(value, default) is equal


def test_weight_shard_counts_follow_tp() -> None:
    """Megatron-LM 0.19 records TP x gtp_weight_remat_size as ``tensor_parallel_num_weight_shards``
    (plain at a remat size of 1): equal to TP it passes, otherwise it changes the layout."""
    check_fields(
        argparse.Namespace(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=2)
    )
    with pytest.raises(LayoutError, match="tensor_parallel_num_weight_shards=4"):
        check_fields(
            argparse.Namespace(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=4)
        )


def _null_tokenizer_run(**fields: object) -> argparse.Namespace:
    run: dict[str, object] = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 1000,
        "padded_vocab_size": 1024,
        "tokenizer_type": "NullTokenizer",
    }
    return argparse.Namespace(**(run | fields))


def test_a_null_tokenizer_runs_end_of_document_row_is_pointed_out_where_it_may_be_dropped() -> None:
    """Megatron-LM's legacy NullTokenizer ends documents with token ``vocab_size`` (a row
    ckptctl takes for padding, which an HF output leaves out); megatron-core's tokenizer
    library, whose releases record ``null_tokenizer_eod_id``, keeps it inside the vocabulary."""
    from ckptctl.formats.megatron_common.args import eod_row_note, spec_from_args

    legacy = _null_tokenizer_run(legacy_tokenizer=True)
    note = eod_row_note(legacy, spec_from_args(legacy), 1)
    assert note is not None and "--true-vocab-size 1001" in note and "its legacy" in note
    unsaid = _null_tokenizer_run()
    note = eod_row_note(unsaid, spec_from_args(unsaid), 1)
    assert note is not None and "if it ran" in note
    library = _null_tokenizer_run(null_tokenizer_eod_id=None)
    assert eod_row_note(library, spec_from_args(library), 1) is None
    padless = _null_tokenizer_run(
        legacy_tokenizer=True, padded_vocab_size=1000, make_vocab_size_divisible_by=8
    )  # 1000 rows: no padding row to lose
    assert eod_row_note(padless, spec_from_args(padless), 1) is None
