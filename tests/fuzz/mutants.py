"""Structure-aware mutants of real checkpoints, seeded and reproducible.

Each mutant is a base checkpoint (a directory the suite wrote with ckptctl's own writers or
torch's) copied and damaged in one way: a file truncated or its bytes flipped; a file replaced
by a FIFO, a directory, a link to ``/dev/zero`` or outside the checkpoint; a torch archive
whose pickle carries hostile tensor geometry, a global off the allow-list, a shared-reference
bomb or a nested list 200,000 deep; Megatron ``args`` and trackers with meaningless values;
JSON documents (``metadata.json``, ``config.json``, the HF index, safetensors headers) of the
wrong type, nested too deep, with duplicate or overlapping tensors; a DCP ``.metadata`` whose
dtypes, chunks or record paths lie. ``mutants(bases, seed)`` lists them; ``Mutant.make`` writes
one.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.fuzz import crafted

Edit = Callable[[Path], None]


@dataclass(frozen=True)
class Mutant:
    base: str
    family: str
    detail: str
    edit: Edit

    @property
    def name(self) -> str:
        return f"{self.base}/{self.family}/{self.detail}"

    @property
    def must_refuse(self) -> bool:
        """Whether the damage leaves nothing a converter may read: ``verify`` must fail it and
        every conversion refuse it. Flipped or cut bytes may fall where a format keeps no
        checksum (a foreign safetensors tensor), and a few mutants stay meaningful."""
        if self.family not in REFUSED_FAMILIES:
            return False
        return (self.family, self.detail) not in STILL_MEANINGFUL

    def make(self, bases: dict[str, Path], root: Path) -> Path:
        out = root / self.name.replace("/", "~")
        shutil.copytree(bases[self.base], out, symlinks=True)
        self.edit(out)
        return out


def _files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink()
    )


# --- bytes and file types ---------------------------------------------------------------------


def truncate(rel: str, keep: float) -> Edit:
    def edit(root: Path) -> None:
        path = root / rel
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])

    return edit


def flip(rel: str, positions: list[float], head: bool) -> Edit:
    def edit(root: Path) -> None:
        path = root / rel
        data = bytearray(path.read_bytes())
        span = min(len(data), 512) if head else len(data)
        for at in positions:
            data[int(at * (span - 1))] ^= 0xFF
        path.write_bytes(bytes(data))

    return edit


def replace_with(rel: str, kind: str) -> Edit:
    def edit(root: Path) -> None:
        path = root / rel
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "directory":
            path.mkdir()
        elif kind == "empty":
            path.write_bytes(b"")
        elif kind in ("zero", "urandom"):
            path.symlink_to(f"/dev/{kind}")
        elif kind == "outside":
            outside = root.parent / f"{root.name}.outside"
            outside.write_bytes(b"not part of the checkpoint")
            path.symlink_to(outside)

    return edit


FILE_KINDS = ("fifo", "directory", "empty", "zero", "urandom", "outside")


# --- torch archives ---------------------------------------------------------------------------


def tensor_geometry(rel: str, how: str) -> Edit:
    """The first tensor of a torch archive rebuilt with hostile geometry over its own storage."""

    def edit(root: Path) -> None:
        path = root / rel
        tree = crafted.load(path)
        where, tensor = crafted.first_tensor(tree)  # type: ignore[misc]
        n = tensor.numel()
        shape, stride, offset = tuple(tensor.shape), tuple(tensor.stride()), 0
        if how == "offset-past-end":
            offset = n + 7
        elif how == "offset-negative":
            offset = -5
        elif how == "stride-negative":
            stride = (-stride[0], *stride[1:])
            offset = n - 1
        elif how == "stride-huge":
            stride = (1 << 40, *stride[1:])
        elif how == "shape-huge":
            shape = (1 << 40, *shape[1:])
        elif how == "shape-negative":
            shape = (-3, *shape[1:])
        crafted.set_at(tree, where, crafted.HostileTensor(tensor, offset, shape, stride))
        crafted.save(tree, path)

    return edit


TENSOR_GEOMETRY = (
    "offset-past-end",
    "offset-negative",
    "stride-negative",
    "stride-huge",
    "shape-huge",
    "shape-negative",
)


def storage_record_missing(rel: str) -> Edit:
    """The zip directory's names of storage records changed, so the pickle's keys find none."""

    def edit(root: Path) -> None:
        path = root / rel
        data = bytearray(path.read_bytes())
        marker = b"/data/0"
        at = data.find(marker)
        while at != -1:
            data[at + len(marker) - 1] = ord("Z")
            at = data.find(marker, at + 1)
        path.write_bytes(bytes(data))

    return edit


def pickled_value(rel: str, key: tuple, value: Callable[[Any], Any]) -> Edit:
    """The archive's state dict with the value at ``key`` replaced."""

    def edit(root: Path) -> None:
        path = root / rel
        tree = crafted.load(path)
        node = tree
        for part in key[:-1]:
            node = getattr(node, part) if isinstance(node, argparse.Namespace) else node[part]
        if isinstance(node, argparse.Namespace):
            setattr(node, key[-1], value(getattr(node, key[-1], None)))
        else:
            node[key[-1]] = value(node.get(key[-1]) if isinstance(node, dict) else None)
        crafted.save(tree, path)

    return edit


def raw_pickle(rel: str, payload: bytes) -> Edit:
    def edit(root: Path) -> None:
        crafted.replace_pickle(root / rel, payload)

    return edit


HOSTILE_VALUES: dict[str, Callable[[Any], Any]] = {
    "forbidden-global": lambda _: crafted.Forbidden(),
    "bytearray-3GiB": lambda _: crafted.Call(bytearray, 3 << 30),
    "shared-bomb": lambda _: crafted.shared_bomb(),
    "numpy-object": lambda _: np.arange(3),
    "a-list": lambda _: [1, 2, 3],
    "none": lambda _: None,
}


# --- Megatron args and trackers ---------------------------------------------------------------


MEGATRON_ARGS: dict[str, Any] = {
    "num_layers=1e9": ("num_layers", 10**9),
    "num_layers-string": ("num_layers", "4"),
    "num_layers-float": ("num_layers", 4.0),
    "num_attention_heads=0": ("num_attention_heads", 0),
    "hidden_size-string": ("hidden_size", "64"),
    "vocab-huge": ("padded_vocab_size", 10**12),
    "iteration=-1": ("iteration", -1),
    "iteration-string": ("iteration", "x"),
    "iteration=2**80": ("iteration", 2**80),
    "iteration-none": ("iteration", None),
    "data_parallel_size=7": ("data_parallel_size", 7),
    "tensor_model_parallel_size=3": ("tensor_model_parallel_size", 3),
}


def megatron_arg(files: list[str], name: str, value: Any, everywhere: bool) -> Edit:
    """Set ``args.<name>`` (or the file's ``iteration``) in one rank file, or in all of them."""

    def edit(root: Path) -> None:
        for rel in files if everywhere else files[:1]:
            path = root / rel
            data = crafted.load(path)
            if name == "iteration":
                data["iteration"] = value
            else:
                setattr(data["args"], name, value)
            crafted.save(data, path)

    return edit


TRACKERS = {
    "5000-digits": b"9" * 5000,
    "not-utf8": b"\xff\xfe\x00\x01",
    "negative": b"-3",
    "empty": b"",
    "release": b"release",
    "huge-number": str(2**80).encode(),
}


def tracker(value: bytes) -> Edit:
    def edit(root: Path) -> None:
        (root / "latest_checkpointed_iteration.txt").write_bytes(value)

    return edit


# --- JSON documents -----------------------------------------------------------------------------


JSON_DOCUMENTS: dict[str, Callable[[Any], Any]] = {
    "a-list": lambda doc: [doc],
    "null": lambda doc: None,
    "a-string": lambda doc: "x",
    "deep": lambda doc: "DEEP",
}


def json_document(rel: str, how: str) -> Edit:
    def edit(root: Path) -> None:
        path = root / rel
        if how == "deep":
            path.write_text("[" * 200_000 + "]" * 200_000)
            return
        doc = json.loads(path.read_text())
        path.write_text(json.dumps(JSON_DOCUMENTS[how](doc)))

    return edit


def json_field(rel: str, key: str, value: Any) -> Edit:
    def edit(root: Path) -> None:
        path = root / rel
        doc = json.loads(path.read_text())
        if value is _DELETE:
            doc.pop(key, None)
        else:
            doc[key] = value
        path.write_text(json.dumps(doc))

    return edit


_DELETE = object()

CONFIG_FIELDS: dict[str, tuple[str, Any]] = {
    "num_hidden_layers=1e9": ("num_hidden_layers", 1e9),
    "num_hidden_layers-int-huge": ("num_hidden_layers", 10**9),
    "num_hidden_layers-string": ("num_hidden_layers", "4"),
    "num_attention_heads=0": ("num_attention_heads", 0),
    "vocab_size-huge": ("vocab_size", 10**12),
    "rope_theta-string": ("rope_theta", "ten thousand"),
    "hidden_size-list": ("hidden_size", [64]),
    "hidden_size-missing": ("hidden_size", _DELETE),
    "model_type-int": ("model_type", 3),
    "rope_scaling-list": ("rope_scaling", [1, 2]),
}


def safetensors_header(rel: str, how: str) -> Edit:
    """The header of a safetensors file rewritten (its data area kept)."""

    def edit(root: Path) -> None:
        path = root / rel
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
        names = sorted(k for k in header if k != "__metadata__")
        first, second = header[names[0]], header[names[1]]
        text: str | None = None
        if how == "offsets-float":
            first["data_offsets"] = [float(v) for v in first["data_offsets"]]
        elif how == "offsets-three":
            first["data_offsets"] = [*first["data_offsets"], 0]
        elif how == "offsets-missing":
            del first["data_offsets"]
        elif how == "offsets-into-header":
            size = first["data_offsets"][1] - first["data_offsets"][0]
            first["data_offsets"] = [-size, 0]
        elif how == "overlap":
            second["data_offsets"] = list(first["data_offsets"])
            second["shape"], second["dtype"] = first["shape"], first["dtype"]
        elif how == "shape-string":
            first["shape"] = "big"
        elif how == "dtype-unknown":
            first["dtype"] = "Q7"
        elif how == "entry-a-list":
            header[names[0]] = [1, 2]
        elif how == "a-list":
            text = json.dumps([header])
        elif how == "deep":
            text = "[" * 100_000 + "]" * 100_000
        elif how == "duplicate":
            body = json.dumps(header)
            text = body[:-1] + ", " + json.dumps(names[0]) + ": " + json.dumps(first) + "}"
        elif how == "length-huge":
            path.write_bytes(struct.pack("<Q", 1 << 60) + raw[8:])
            return
        body = (text if text is not None else json.dumps(header)).encode()
        body += b" " * (-len(body) % 8)
        path.write_bytes(struct.pack("<Q", len(body)) + body + data)

    return edit


SAFETENSORS_HEADERS = (
    "offsets-float",
    "offsets-three",
    "offsets-missing",
    "offsets-into-header",
    "overlap",
    "shape-string",
    "dtype-unknown",
    "entry-a-list",
    "a-list",
    "deep",
    "duplicate",
    "length-huge",
)


def hf_index(how: str) -> Edit:
    def edit(root: Path) -> None:
        path = root / "model.safetensors.index.json"
        doc = json.loads(path.read_text())
        first = sorted(doc["weight_map"])[0]
        if how == "path-int":
            doc["weight_map"][first] = 7
        elif how == "path-list":
            doc["weight_map"][first] = ["a"]
        elif how == "path-nul":
            doc["weight_map"][first] = "model\x00.safetensors"
        elif how == "path-escaping":
            doc["weight_map"][first] = "../../etc/passwd"
        elif how == "weight_map-list":
            doc["weight_map"] = list(doc["weight_map"])
        elif how == "weight_map-missing":
            del doc["weight_map"]
        path.write_text(json.dumps(doc))

    return edit


HF_INDEX = (
    "path-int",
    "path-list",
    "path-nul",
    "path-escaping",
    "weight_map-list",
    "weight_map-missing",
)


# --- DCP .metadata ------------------------------------------------------------------------------


def dcp_metadata(rel: str, how: str) -> Edit:
    """``.metadata`` unpickled by torch (the suite wrote it), changed, and pickled back."""

    def edit(root: Path) -> None:
        path = root / rel
        with open(path, "rb") as f:
            meta = pickle.load(f)
        entries = meta.state_dict_metadata
        name = next(k for k, v in entries.items() if hasattr(v, "chunks") and len(v.size) >= 1)
        entry = entries[name]
        index = next(i for i in meta.storage_data if i.fqn == name)
        info = meta.storage_data[index]
        if how == "dtype-disagrees":
            entry.properties.dtype = (
                torch.float16 if entry.properties.dtype != torch.float16 else torch.float32
            )
        elif how == "chunk-outside":
            entry.chunks[0].offsets = torch.Size([entry.size[0] + 5, *entry.chunks[0].offsets[1:]])
        elif how == "size-huge":
            entry.size = torch.Size([1 << 40, *entry.size[1:]])
        elif how == "record-escaping":
            info.relative_path = "../../outside.distcp"
        elif how == "record-int":
            info.relative_path = 3
        elif how == "record-nul":
            info.relative_path = "__0\x00_0.distcp"
        elif how == "record-offset-past-end":
            info.offset = 1 << 40
        elif how == "record-length-huge":
            info.length = 1 << 40
        elif how == "planner-bomb":
            meta.planner_data = {"x": crafted.shared_bomb(30, 10)}
        with open(path, "wb") as f:
            pickle.dump(meta, f)

    return edit


DCP_METADATA = (
    "dtype-disagrees",
    "chunk-outside",
    "size-huge",
    "record-escaping",
    "record-int",
    "record-nul",
    "record-offset-past-end",
    "record-length-huge",
    "planner-bomb",
)


REFUSED_FAMILIES = frozenset(
    {
        "file-type",
        "tensor-geometry",
        "storage-record",
        "pickle",
        "model-entry",
        "scheduler",
        "args",
        "common-args",
        "common-entry",
        "metadata.json",
        "dcp-metadata",
        "config.json",
        "config-field",
        "safetensors-header",
        "hf-index",
        "tracker",
    }
)
STILL_MEANINGFUL = frozenset(
    {
        # A DP size no file contradicts (no distributed optimizer).
        ("args", "data_parallel_size=7@all"),
        ("common-args", "data_parallel_size=7"),
        # A scheduler's state is carried as it is: Megatron reads it, ckptctl does not.
        ("scheduler", "numpy-object"),
        ("scheduler", "a-list"),
        ("scheduler", "none"),
    }
)
"""Mutants of a refused family whose result is still a checkpoint (``must_refuse``)."""


# --- the list ------------------------------------------------------------------------------------


def mutants(bases: dict[str, Path], seed: int = 0) -> list[Mutant]:
    """Every mutant of the suite's families, over the given base checkpoints; the random parts
    (which file, where to cut or flip) are drawn from ``seed``."""
    rng = random.Random(seed)
    out: list[Mutant] = []
    for base, root in sorted(bases.items()):
        files = _files(root)
        data_files = [f for f in files if not f.endswith((".json", ".txt"))]
        for rel in rng.sample(files, min(6, len(files))):
            for keep in (0.0, rng.random()):
                out.append(Mutant(base, "truncate", f"{rel}@{keep:.2f}", truncate(rel, keep)))
        for n, rel in enumerate(rng.choices(files, k=8)):
            head = rng.random() < 0.5
            spots = [rng.random() for _ in range(rng.choice((1, 4)))]
            detail = f"{rel}@{'head' if head else 'body'}x{len(spots)}#{n}"
            out.append(Mutant(base, "flip", detail, flip(rel, spots, head)))
        for kind in FILE_KINDS:
            rel = rng.choice(data_files or files)
            out.append(Mutant(base, "file-type", f"{rel}->{kind}", replace_with(rel, kind)))
        archives = [f for f in data_files if f.endswith((".pt", ".pth")) and "common" not in f]
        for rel in archives[:1]:
            for how in TENSOR_GEOMETRY:
                out.append(
                    Mutant(base, "tensor-geometry", f"{rel}:{how}", tensor_geometry(rel, how))
                )
            out.append(
                Mutant(base, "storage-record", f"{rel}:missing", storage_record_missing(rel))
            )
            out.append(
                Mutant(
                    base,
                    "pickle",
                    f"{rel}:deep-list",
                    raw_pickle(rel, crafted.deep_list_pickle(200_000)),
                )
            )
        out.extend(_by_base(base, root, files))
    return out


def _tensor_count(path: Path) -> int:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return len(json.loads(raw[8 : 8 + n])) - 1


def _by_base(base: str, root: Path, files: list[str]) -> list[Mutant]:
    out: list[Mutant] = []
    ranks = [f for f in files if f.endswith("model_optim_rng.pt")]
    if ranks:  # Megatron legacy
        for how, value in HOSTILE_VALUES.items():
            out.append(Mutant(base, "model-entry", how, pickled_value(ranks[0], ("model",), value)))
            out.append(
                Mutant(
                    base, "scheduler", how, pickled_value(ranks[0], ("opt_param_scheduler",), value)
                )
            )
        for how, (name, value) in MEGATRON_ARGS.items():
            out.append(Mutant(base, "args", f"{how}@all", megatron_arg(ranks, name, value, True)))
        out.append(
            Mutant(
                base, "args", "num_layers=1e9@one", megatron_arg(ranks, "num_layers", 10**9, False)
            )
        )
        if any(f.endswith("distrib_optim.pt") for f in files):
            for dp in (1, 4):  # the buffers were cut for DP2
                edit = megatron_arg(ranks, "data_parallel_size", dp, True)
                out.append(Mutant(base, "args", f"dp={dp}-against-buffers@all", edit))
        for how, value in TRACKERS.items():
            out.append(Mutant(base, "tracker", how, tracker(value)))
    common = [f for f in files if f.endswith("common.pt")]
    if common:  # torch_dist
        for how, (name, value) in MEGATRON_ARGS.items():
            out.append(Mutant(base, "common-args", how, megatron_arg(common, name, value, True)))
        for how, value in HOSTILE_VALUES.items():
            out.append(
                Mutant(base, "common-entry", how, pickled_value(common[0], ("args",), value))
            )
        for rel in [f for f in files if f.endswith("metadata.json")]:
            for how in JSON_DOCUMENTS:
                out.append(Mutant(base, "metadata.json", how, json_document(rel, how)))
    for rel in [f for f in files if f.endswith(".metadata")]:
        for how in DCP_METADATA:
            out.append(Mutant(base, "dcp-metadata", how, dcp_metadata(rel, how)))
    for rel in [f for f in files if f.endswith("config.json")]:
        for how in JSON_DOCUMENTS:
            out.append(Mutant(base, "config.json", how, json_document(rel, how)))
        for how, (key, value) in CONFIG_FIELDS.items():
            out.append(Mutant(base, "config-field", how, json_field(rel, key, value)))
    shards = [f for f in files if f.endswith(".safetensors")]
    for rel in sorted(shards, key=lambda f: -_tensor_count(root / f))[:1]:
        for how in SAFETENSORS_HEADERS:
            out.append(Mutant(base, "safetensors-header", how, safetensors_header(rel, how)))
    if "model.safetensors.index.json" in files:
        for how in HF_INDEX:
            out.append(Mutant(base, "hf-index", how, hf_index(how)))
        for how in JSON_DOCUMENTS:
            out.append(
                Mutant(base, "hf-index", how, json_document("model.safetensors.index.json", how))
            )
    return out
