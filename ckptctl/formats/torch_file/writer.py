"""Writing one ``torch.save`` file of a whole state dict, as torch's ``dcp_to_torch_save`` does:
tensors at their key paths, streamed; other items restored from the source's byte records."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from typing import Any

from ckptctl.formats.base import WriteJob
from ckptctl.formats.torchsave.archive import TensorRef
from ckptctl.formats.torchsave.zip_writer import TensorSlot, write_torch_zip
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.runs import Run
from ckptctl.model.plan import FileWrite


def write_state_dict_file(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    """One ``torch.save`` file of a whole state dict, as ``dcp_to_torch_save`` writes it:
    tensors at their key paths, non-tensor items restored from the source's byte records."""
    owner, assemble = job.source.primary, job.assemble
    # A source that nests its state dict (DCP) says where each name sits and which items are
    # not tensors; any other source is a flat mapping of names to tensors.
    key_path = owner.key_path
    tree: Any = {}
    slots = []
    by_key = {}
    at_path = {}
    for n, tensor in enumerate(file.tensors):
        slot = TensorSlot(str(n), tensor.dtype, tensor.shape)
        # A one-element key is a stored name (placed by the source); a longer one, the path.
        path = key_path(str(tensor.key[0])) if len(tensor.key) == 1 else tensor.key
        _set_path(tree, path, slot)
        at_path[tuple(path)] = slot
        slots.append(slot)
        by_key[slot.key] = tensor
    inner: dict[str, tuple[Any, TensorRef]] = {}
    for path, value, reader in _items(owner):
        # Tensors inside pickled items (RNG states, Adam's step) are copied from their file.
        value = _slots_for_refs(value, lambda ref, r=reader: _inner_slot(ref, r, inner, slots))
        _set_path(tree, path, value)
    for alias, target in owner.state_dict_aliases().items():
        # Tied weights: one storage under two names, as torch.save keeps them.
        _set_path(tree, alias, at_path[target])

    def produce(slot: TensorSlot) -> Iterator[memoryview | Run]:
        if slot.key in inner:
            reader, ref = inner[slot.key]
            from ckptctl.arrays import raw_bytes  # numpy: only when bytes are handled

            yield raw_bytes(reader.read(ref))
        else:
            yield from assemble.chunks(by_key[slot.key], file.path)

    assemble.expect(by_key[s.key] for s in slots if s.key not in inner)
    write_torch_zip(out, tree, slots, produce)


def _items(owner: Any) -> list[tuple[tuple[Any, ...], Any, Any]]:
    """Non-tensor items of the state dict: (key path, value, reader of tensors inside it)."""
    if (items := owner.state_dict_items()) is not None:
        return items
    key_path = owner.key_path
    out = []
    for fqn in owner.byte_items():
        value, reader = owner.byte_item(fqn)
        out.append((key_path(fqn), value, reader))
    return out


def _inner_slot(
    ref: TensorRef, reader: Any, inner: dict[str, tuple[Any, TensorRef]], slots: list[TensorSlot]
) -> TensorSlot:
    slot = TensorSlot(f"item{len(inner)}", ref.dtype, ref.shape)
    inner[slot.key] = (reader, ref)
    slots.append(slot)
    return slot


def _slots_for_refs(obj: Any, make: Any) -> Any:
    if isinstance(obj, TensorRef):
        return make(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _slots_for_refs(v, make)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(_slots_for_refs(v, make) for v in obj)
    return obj


def _set_path(tree: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set ``tree[path[0]][path[1]]... = value``, creating dicts (or lists for int keys)."""
    node = tree
    for key, following in pairwise(path):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(following, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(following, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value
