"""transformers as the judge of an HF model ckptctl has no family table for: the model its
``config.json`` describes is built on the meta device (no memory, no weights) and its
``state_dict()`` says which tensors, of which shapes, a checkpoint of it must hold, which share
one parameter, and under which names ``save_pretrained`` writes them.

Only classes transformers itself exports are built: a config's ``auto_map`` (remote code) is
never followed.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from ckptctl.errors import CheckpointError, UsageError
from ckptctl.model.geometry import Shape
from ckptctl.model.hf_named import HfNamedModel


def _architecture(config: Mapping[str, Any], where: str) -> str:
    names = config.get("architectures")
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise CheckpointError(
            f'{where}: names no architecture ("architectures"), so the model it describes '
            "is unknown",
            hint="give the model's own config.json (--hf-config)",
        )
    name = names[0]
    if not name.isidentifier():
        raise CheckpointError(f"{where}: architecture {name!r} is not a class name")
    return name


def build_names(config: Mapping[str, Any], where: str) -> HfNamedModel:
    """The tensors of the model ``config`` describes, as transformers builds it."""
    architecture = _architecture(config, where)
    try:
        import torch
        import transformers
    except ImportError:
        raise UsageError(
            f"{where}: {architecture} has no family table in ckptctl; checking a checkpoint of "
            "it against its config needs transformers (pip install transformers)"
        ) from None
    cls = getattr(transformers, architecture, None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise CheckpointError(
            f"{where}: transformers {transformers.__version__} has no model class "
            f"{architecture}; ckptctl never runs a checkpoint's own code",
            hint="install the transformers release that added this architecture",
        )
    if "quantization_config" in config:  # the weights would be written as they are stored
        raise CheckpointError(
            f"{where}: quantization_config: quantized weights are read for the families "
            f"ckptctl maps only, not {architecture}"
        )
    declared = getattr(cls.config_class, "model_type", "") or ""
    if declared and config.get("model_type") != declared:
        raise CheckpointError(
            f"{where}: model_type is {config.get('model_type')!r}, but {architecture} is a "
            f"{declared!r} model; the config is damaged or not this model's"
        )
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config_class = cls.config_class
            if config_class is None:
                raise CheckpointError(f"{where}: {architecture} declares no config class")
            model_config = config_class.from_dict(dict(config))
            with torch.device("meta"):
                model = cls(model_config)
    except Exception as err:  # transformers raises anything on a config it cannot build
        said = [line.strip() for line in str(err).splitlines() if line.strip()]
        reason = said[-1] if said else type(err).__name__  # one line: its last says why
        raise CheckpointError(
            f"{where}: transformers cannot build {architecture} from it: {reason}"
        ) from None
    finally:
        quiet.setLevel(level)
    return describe(model, architecture)


def describe(model: Any, architecture: str) -> HfNamedModel:
    """Names, shapes, ties and hub names of a built (meta) model."""
    state = model.state_dict()
    tensors = tuple((name, tuple(int(n) for n in value.shape)) for name, value in state.items())
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    hub, converted, hub_converted = _hub_names(model, state)
    tied = []
    for names in groups.values():
        held = [n for n in names if n in state]
        kept = _kept_of_tie(model, held)
        tied += [(alias, kept) for alias in held if alias != kept]
    parameters = tuple(name for name, _ in model.named_parameters())
    return HfNamedModel(
        architecture,
        tensors,
        hub,
        converted,
        tuple(tied),
        parameters=parameters,
        hub_converted=hub_converted,
    )


def _kept_of_tie(model: Any, names: list[str]) -> str:
    """Which name of a tied group ``save_pretrained`` keeps: the tie's source, as the model's
    ``_tied_weights_keys`` (target -> source) says, else the first."""
    declared = getattr(model, "_tied_weights_keys", None)
    if isinstance(declared, dict):
        for name in names:
            if name in declared.values() and name not in declared:
                return name
    return names[0]


def _hub_names(
    model: Any, state: dict[str, Any]
) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...], tuple[tuple[str, Shape], ...]]:
    """transformers 5 renames some tensors between memory and the hub (and converts others,
    e.g. packed experts): its own reversal, run on the meta tensors, tells which; a renamed
    tensor comes back as the same object under its hub name."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: in-memory names are the hub's
        return (), (), ()
    import torch

    # One distinct meta tensor per name: tied names share one tensor in the state dict.
    fresh = {name: torch.empty_like(value) for name, value in state.items()}
    out = revert_weight_conversion(model, dict(fresh))
    by_id = {id(value): hub for hub, value in out.items()}
    renamed = []
    converted = []
    for name, value in fresh.items():
        hub = by_id.get(id(value))
        if hub is None:
            converted.append(name)
        elif hub != name:
            renamed.append((name, hub))
    mapped = {by_id[id(v)] for v in fresh.values() if id(v) in by_id}
    outputs = tuple(
        (hub, tuple(int(n) for n in value.shape)) for hub, value in out.items() if hub not in mapped
    )
    return tuple(renamed), tuple(converted), outputs
