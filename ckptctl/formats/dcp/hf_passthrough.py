"""DCP checkpoints of any HF model (FSDP2 training of a VLM, of a family ckptctl has no table
for): each model tensor is its own canonical tensor under the name ``save_pretrained`` gives
it, checked against the model transformers builds from the ``config.json`` (every tensor
present, of its shape, nothing else under the model's prefix). Pure.

The state dict's prefix (``model.`` for ``{"model": model_state_dict}``) is found by the names
the model has: the prefix under which most of them are held.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.formats.dcp_container.files import chunks_placed, join
from ckptctl.formats.dcp_container.metadata import DcpMetadata, StorageInfo, TensorEntry
from ckptctl.model.catalog import state_name
from ckptctl.model.hf_named import HfNamedModel
from ckptctl.model.stored import Replica, StoredTensor

ADAM_STATES = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True)
class NamedTensors:
    placed: list[tuple[StorageInfo, StoredTensor]]
    replicas: tuple[Replica, ...]
    has_optimizer: bool
    notes: tuple[str, ...]
    problems: list[str]


def _prefix_counts(keys: list[str], names: set[str], suffix: str = "") -> dict[str, int]:
    """How many of ``names`` each prefix of the ``keys`` holds (``prefix + name + suffix``)."""
    counts: dict[str, int] = {}
    for key in keys:
        if suffix:
            if not key.endswith(suffix):
                continue
            key = key[: -len(suffix)]
        cut = -1
        while True:
            rest = key[cut + 1 :]
            if rest in names:
                prefix = key[: cut + 1]
                counts[prefix] = counts.get(prefix, 0) + 1
                break
            cut = key.find(".", cut + 1)
            if cut < 0:
                break
    return counts


def model_prefix(keys: list[str], model: HfNamedModel) -> str | None:
    """The prefix under which the checkpoint holds most of the model's tensors (``None``: it
    holds none of them: its names are not this model's)."""
    counts = _prefix_counts(keys, set(model.shapes()))
    if not counts:
        return None
    return max(counts, key=lambda p: (counts[p], -len(p)))


def _optimizer_prefix(keys: list[str], model: HfNamedModel) -> str | None:
    counts = _prefix_counts(keys, set(model.shapes()), ".exp_avg")
    return max(counts, key=lambda p: (counts[p], -len(p))) if counts else None


def named_tensors(metadata: DcpMetadata, model: HfNamedModel, base: str) -> NamedTensors:
    """Every model tensor's chunks under its hub name, or the problems that stop it."""
    entries = {k: e for k, e in metadata.entries.items() if isinstance(e, TensorEntry)}
    keys = list(entries)
    prefix = model_prefix(keys, model) or ""
    optim = _optimizer_prefix(keys, model)
    shapes = model.shapes()
    tied = dict(model.tied)
    problems: list[str] = []
    placed: list[tuple[StorageInfo, StoredTensor]] = []
    for name, shape in model.tensors:
        fqn = prefix + name
        entry = entries.get(fqn)
        if entry is None:
            if name not in tied:  # a tied alias is written once, as its kept name
                problems.append(f"{fqn} missing")
            continue
        if entry.shape != shape:
            problems.append(f"{fqn} has shape {list(entry.shape)}; config says {list(shape)}")
            continue
        if name in tied:
            continue
        placed += chunks_placed(metadata, fqn, entry, model.hub_name(name))
    states, other_states = _adam_state(metadata, entries, optim, model)
    placed += states
    strays = sorted(k for k in keys if k.startswith(prefix) and k[len(prefix) :] not in shapes)
    if optim is not None and optim.startswith(prefix):
        strays = [k for k in strays if not k.startswith(optim)]
    if strays:
        shown = ", ".join(strays[:3]) + (f" and {len(strays) - 3} more" if len(strays) > 3 else "")
        problems.append(
            f"holds {shown}, which {model.architecture} has no place for (is the config.json "
            "the checkpoint's own?)"
        )
    replicas = tied_copies(metadata, entries, prefix, tied, base, problems)
    notes = [f"PyTorch DCP checkpoint of an HF {model.architecture} (checked by transformers)"]
    renamed = sum(1 for n, _ in model.tensors if model.hub_name(n) != n)
    if renamed:
        notes.append(f"{renamed} tensors take the hub's names (as save_pretrained writes them)")
    held_converted = [n for n in model.converted if prefix + n in entries]
    if held_converted:
        notes.append(
            f"{len(held_converted)} tensors kept as transformers holds them in memory (e.g. "
            f"{held_converted[0]}): save_pretrained converts them in a way ckptctl does not "
            "repeat for this architecture; transformers 5 loads them as they are"
        )
    if other_states:
        notes.append(
            f"{other_states} optimizer-state tensors other than Adam's step and moments are "
            "not read"
        )
    return NamedTensors(placed, replicas, optim is not None, tuple(notes), problems)


def _adam_state(
    metadata: DcpMetadata,
    entries: dict[str, TensorEntry],
    optim: str | None,
    model: HfNamedModel,
) -> tuple[list[tuple[StorageInfo, StoredTensor]], int]:
    """Adam's step and moments of each parameter (``<optim prefix><name>.<state>``, as
    torch's ``get_optimizer_state_dict`` keys them), under the canonical state names of its
    hub name; and how many other state tensors there are."""
    if optim is None:
        return [], 0
    tied = dict(model.tied)
    out = []
    read = set()
    for name, _ in model.tensors:
        if name in tied:
            continue
        for state in (*ADAM_STATES, "step"):
            fqn = f"{optim}{name}.{state}"
            entry = entries.get(fqn)
            if entry is None:
                continue
            read.add(fqn)
            canonical = state_name(state, model.hub_name(name))
            out += chunks_placed(metadata, fqn, entry, canonical)
    others = sum(1 for k in entries if k.startswith(optim) and k not in read)
    return out, others


def tied_copies(
    metadata: DcpMetadata,
    entries: dict[str, TensorEntry],
    prefix: str,
    tied: dict[str, str],
    base: str,
    problems: list[str],
) -> tuple[Replica, ...]:
    """A tied alias the checkpoint holds too is a copy of its kept tensor, chunk for chunk:
    checked equal, never written."""
    out = []
    for alias, kept in tied.items():
        copy, original = entries.get(prefix + alias), entries.get(prefix + kept)
        if copy is None or original is None:
            continue
        if [(c.offsets, c.sizes) for c in copy.chunks] != [
            (c.offsets, c.sizes) for c in original.chunks
        ]:
            problems.append(f"{prefix + alias} (tied to {prefix + kept}) is cut differently")
            continue
        for chunk in original.chunks:
            info = metadata.storage[(prefix + kept, chunk.offsets)]
            copy_info = metadata.storage[(prefix + alias, chunk.offsets)]
            out.append(
                Replica(
                    join(base, info.relative_path),
                    (prefix + kept, *chunk.offsets),
                    chunk.sizes,
                    join(base, copy_info.relative_path),
                    (prefix + alias, *chunk.offsets),
                )
            )
    return tuple(out)
