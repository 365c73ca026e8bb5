"""DCP ``.metadata``: our restricted reader against files torch itself writes, hostile files, the
coverage checks, and our writer against torch's own ``dcp.load``."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as tmd
from torch.distributed.checkpoint import planner as tplanner

from ckptctl.arrays import from_torch, raw_bytes, to_torch
from ckptctl.errors import CheckpointError, UnsafePickleError
from ckptctl.formats.dcp_container.checks import check_metadata, metadata_problems
from ckptctl.formats.dcp_container.metadata import (
    DCP_VERSION,
    DTYPE_NAMES,
    METADATA_FILE,
    BytesEntry,
    Chunk,
    DcpMetadata,
    SaveInfo,
    StorageInfo,
    TensorEntry,
)
from ckptctl.formats.dcp_container.parse import parse_metadata
from ckptctl.formats.dcp_container.records import RecordWindow, open_tensor_record
from ckptctl.formats.dcp_container.write import (
    metadata_bytes,
    write_bytes_record,
    write_tensor_record,
)
from ckptctl.formats.torchsave.archive import TorchZipReader
from ckptctl.formats.torchsave.zip_writer import TensorSlot

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MCORE = "megatron.core.dist_checkpointing.strategies.torch"


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(4, 6, generator=gen),
            "b": torch.randn(5, generator=gen).to(torch.bfloat16),
            "scale": torch.tensor(2.5),
            "layers": {"0": {"w": torch.randn(2, 3, generator=gen)}},
        },
        "step": 7,
        "name": "run-1",
    }


TENSORS = {  # fqn -> (key path, dtype, shape)
    "model.w": (("model", "w"), "float32", (4, 6)),
    "model.b": (("model", "b"), "bfloat16", (5,)),
    "model.scale": (("model", "scale"), "float32", ()),
    "model.layers.0.w": (("model", "layers", "0", "w"), "float32", (2, 3)),
}
BYTE_ITEMS = {"step": 7, "name": "run-1"}


def _lookup(tree: dict[str, Any], path: tuple[str | int, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture
def torch_ckpt(tmp_path: Path) -> Path:
    """A checkpoint written by torch's own DCP save, single process."""
    out = tmp_path / "ckpt"
    dcp.save(_state(), checkpoint_id=out, no_dist=True)
    return out


def _parse(ckpt: Path) -> DcpMetadata:
    path = ckpt / METADATA_FILE
    return parse_metadata(path.read_bytes(), str(path))


def _torch_metadata(ckpt: Path) -> tmd.Metadata:
    """torch's own unpickling: fine here, the test wrote the file."""
    return dcp.FileSystemReader(ckpt).read_metadata()


# --- reading what torch writes -----------------------------------------------------------------


def test_parse_gives_fqns_geometry_and_planner_data(torch_ckpt: Path) -> None:
    md = _parse(torch_ckpt)
    assert set(md.entries) == set(TENSORS) | set(BYTE_ITEMS)
    for fqn, (path, dtype, shape) in TENSORS.items():
        zero = (0,) * len(shape)
        assert md.entries[fqn] == TensorEntry(
            dtype=dtype, shape=shape, chunks=(Chunk(offsets=zero, sizes=shape),)
        )
        assert md.planner_data is not None and md.planner_data[fqn] == path
    assert all(md.entries[k] == BytesEntry() for k in BYTE_ITEMS)
    assert md.version == DCP_VERSION
    assert md.save_info is not None and md.save_info.checkpoint_id == str(torch_ckpt)
    assert md.ignored == ()
    assert metadata_problems(md) == []


def test_storage_ranges_match_torch_own_reading(torch_ckpt: Path) -> None:
    theirs = {
        (k.fqn, None if k.offset is None else tuple(k.offset)): (
            v.relative_path,
            v.offset,
            v.length,
        )
        for k, v in _torch_metadata(torch_ckpt).storage_data.items()
    }
    ours = {k: (v.relative_path, v.offset, v.length) for k, v in _parse(torch_ckpt).storage.items()}
    assert ours == theirs
    assert ("model.scale", ()) in ours and ("step", None) in ours


def test_each_tensor_record_reads_bitwise_through_a_window(torch_ckpt: Path) -> None:
    md, state = _parse(torch_ckpt), _state()
    for fqn, (path, _, _) in TENSORS.items():
        entry = md.entries[fqn]
        assert isinstance(entry, TensorEntry)
        chunk = entry.chunks[0]
        info = md.storage[(fqn, chunk.offsets)]
        with open(torch_ckpt / info.relative_path, "rb") as f:
            reader, ref = open_tensor_record(f, info, entry.dtype, chunk.sizes, fqn)
            got = to_torch(reader.read(ref))
        want = _lookup(state, path)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(_bits(got), _bits(want))


def test_byte_records_are_torch_save_archives(torch_ckpt: Path) -> None:
    md = _parse(torch_ckpt)
    for fqn, value in BYTE_ITEMS.items():
        info = md.storage[(fqn, None)]
        with open(torch_ckpt / info.relative_path, "rb") as f:
            window = RecordWindow(f, info.offset, info.length)
            assert torch.load(window, weights_only=True) == value


def test_without_a_window_a_zip_reader_silently_opens_the_last_record(torch_ckpt: Path) -> None:
    """Why the window exists: a zip is located from the end of its file."""
    md = _parse(torch_ckpt)
    last = max(md.storage.items(), key=lambda kv: kv[1].offset)
    with open(torch_ckpt / last[1].relative_path, "rb") as f:
        whole = TorchZipReader(f, "whole file").tree
    assert whole.shape == TENSORS[last[0][0]][2]


# --- hostile files -----------------------------------------------------------------------------


class _Call:
    """Pickles as ``fn(*args)``: what a malicious checkpoint runs under plain ``pickle.load``."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.fn, self.args


def _payload(kind: str, marker: Path, ckpt: Path) -> bytes:
    if kind == "os.system":
        return pickle.dumps(_Call(os.system, f"touch {marker}"))
    if kind == "builtins.eval":
        return pickle.dumps(_Call(eval, f"open({str(marker)!r}, 'w').close()"))
    # deep inside an otherwise genuine Metadata, after many allowed globals
    md = _torch_metadata(ckpt)
    md.storage_meta.checkpoint_id = _Call(eval, f"open({str(marker)!r}, 'w').close()")
    return pickle.dumps(md)


@pytest.mark.parametrize(
    ("kind", "named"),
    [("os.system", "posix.system"), ("builtins.eval", "builtins.eval"), ("nested", "eval")],
)
def test_malicious_metadata_is_refused_before_anything_runs(
    torch_ckpt: Path, tmp_path: Path, kind: str, named: str
) -> None:
    marker = tmp_path / "pwned"
    path = torch_ckpt / METADATA_FILE
    path.write_bytes(_payload(kind, marker, torch_ckpt))
    with pytest.raises(UnsafePickleError) as err:
        parse_metadata(path.read_bytes(), str(path))
    assert isinstance(err.value, CheckpointError)
    assert named in str(err.value) and str(path) in str(err.value)
    assert not marker.exists()


def test_the_payload_is_live_under_plain_pickle(torch_ckpt: Path, tmp_path: Path) -> None:
    """Control for the test above: the same bytes do run code when unpickled the torch way."""
    marker = tmp_path / "pwned"
    pickle.loads(_payload("nested", marker, torch_ckpt))
    assert marker.exists()


@pytest.mark.parametrize(
    "bad", ["../outside.distcp", "/etc/passwd", "sub/../../x.distcp", "..\\x.distcp", "C:\\x"]
)
def test_record_path_escaping_the_checkpoint_is_refused(torch_ckpt: Path, bad: str) -> None:
    md = _torch_metadata(torch_ckpt)
    next(iter(md.storage_data.values())).relative_path = bad
    with pytest.raises(CheckpointError, match="escapes the checkpoint directory"):
        parse_metadata(pickle.dumps(md), "evil/.metadata")


def test_unknown_stream_transform_is_reported_and_refused(torch_ckpt: Path) -> None:
    md = _torch_metadata(torch_ckpt)
    index = next(k for k in md.storage_data if k.fqn == "model.w")
    md.storage_data[index].transform_descriptors = ["stream.zstd/1"]
    ours = parse_metadata(pickle.dumps(md), "z/.metadata")
    (problem,) = metadata_problems(ours)
    assert "model.w" in problem and "stream.zstd/1" in problem
    with pytest.raises(CheckpointError, match=r"z/\.metadata: 1 problem"):
        check_metadata(ours, "z/.metadata")
    with pytest.raises(CheckpointError, match="stream transform"):
        open_tensor_record(io.BytesIO(), ours.storage[("model.w", (0, 0))], "float32", (4, 6), "w")


# --- megatron-core's additions -----------------------------------------------------------------


@dataclasses.dataclass
class _OldMCoreMetadata(tmd.Metadata):
    """megatron-core <= 0.15's Metadata subclass; pickled under megatron's name below."""

    mcore_data: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _OldMCoreSavePlan(tplanner.SavePlan):
    mcore_data: dict[str, Any] = dataclasses.field(default_factory=dict)


class _RenamingPickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes chosen classes under other global names, so no megatron import is needed."""

    def __init__(self, file: io.BytesIO, names: dict[Any, tuple[str, str]]) -> None:
        super().__init__(file, protocol=4)
        self.names = names

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj in self.names:
            module, qualname = self.names[obj]
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _dumps_renamed(obj: Any, names: dict[Any, tuple[str, str]]) -> bytes:
    buf = io.BytesIO()
    _RenamingPickler(buf, names).dump(obj)
    return buf.getvalue()


def _megatron_style(ckpt: Path, mcore_data: dict[str, Any]) -> bytes:
    """torch's metadata as megatron-core writes it: MCoreMetadata carrying ``mcore_data``, and
    ``all_local_plans`` (0.16.1: plain SavePlans; older releases: MCoreSavePlan)."""
    md = _torch_metadata(ckpt)
    item = tplanner.WriteItem(
        index=tmd.MetadataIndex("model.w", (0, 0)),
        type=tplanner.WriteItemType.SHARD,
        tensor_data=tplanner.TensorWriteData(
            chunk=tmd.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 6])),
            properties=tmd.TensorProperties(dtype=torch.float32),
            size=torch.Size([4, 6]),
        ),
    )
    plans = [tplanner.SavePlan(items=[item]), _OldMCoreSavePlan(items=[item], mcore_data={})]
    old = _OldMCoreMetadata(**vars(md), mcore_data=mcore_data)
    old.all_local_plans = plans
    names = {
        _OldMCoreMetadata: (MCORE, "MCoreMetadata"),
        _OldMCoreSavePlan: (MCORE, "MCoreSavePlan"),
    }
    return _dumps_renamed(old, names)


def test_megatron_metadata_keeps_plain_mcore_data_and_skips_plans(torch_ckpt: Path) -> None:
    mcore = {"model.w": {"nd_reformulated_orig_global_shape": (2, 2, 6)}}
    md = parse_metadata(_megatron_style(torch_ckpt, mcore), "mcore/.metadata")
    assert md.mcore_data == mcore
    assert md.ignored == ("Metadata.all_local_plans",)
    assert md.entries == _parse(torch_ckpt).entries
    assert metadata_problems(md) == []


def test_megatron_mcore_data_holding_objects_is_dropped_not_executed(torch_ckpt: Path) -> None:
    mcore = {"model.w": tplanner.SavePlan(items=[])}
    md = parse_metadata(_megatron_style(torch_ckpt, mcore), "mcore/.metadata")
    assert md.mcore_data is None
    assert "Metadata.mcore_data (holds objects, not plain data)" in md.ignored


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_checkpoint_id_paths_of_either_python_spelling_become_strings(
    torch_ckpt: Path, module: str
) -> None:
    """Python 3.13 pickles ``PosixPath`` as ``pathlib._local.PosixPath``."""
    md = _torch_metadata(torch_ckpt)
    md.storage_meta.checkpoint_id = Path("/ckpts/run-1")
    data = _dumps_renamed(md, {type(Path()): (module, "PosixPath")})
    info = parse_metadata(data, "p/.metadata").save_info
    assert info is not None and info.checkpoint_id == "/ckpts/run-1"


# --- coverage checks (pure) --------------------------------------------------------------------


def _one_tensor(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> DcpMetadata:
    chunks = tuple(Chunk(offsets=o, sizes=s) for o, s in boxes)
    storage = {
        ("t", c.offsets): StorageInfo(relative_path="__0_0.distcp", offset=i, length=1)
        for i, c in enumerate(chunks)
    }
    entry = TensorEntry(dtype="float32", shape=shape, chunks=chunks)
    return DcpMetadata(entries={"t": entry}, storage=storage)


@pytest.mark.parametrize(
    ("shape", "boxes", "problem"),
    [
        ((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))], None),
        ((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))], None),
        ((), [((), ())], None),
        ((0, 3), [((0, 0), (0, 3))], None),
        ((4, 6), [((0, 0), (2, 6)), ((2, 0), (3, 6))], "lies outside shape (4, 6)"),
        ((4, 6), [((0, 0), (3, 6)), ((2, 0), (2, 6))], "overlap"),
        ((4, 6), [((0, 0), (2, 6)), ((0, 0), (2, 6))], "overlap"),
        ((), [((), ()), ((), ())], "overlap"),
        ((4, 6), [((0, 0), (2, 6))], "chunks cover 12 of 24 elements"),
        ((4, 6), [((0,), (4,))], "has rank 1"),
    ],
)
def test_coverage_problems(
    shape: tuple[int, ...],
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    problem: str | None,
) -> None:
    problems = metadata_problems(_one_tensor(shape, boxes))
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_all_problems_are_reported_together() -> None:
    md = _one_tensor((4, 6), [((0, 0), (2, 6))])
    md = dataclasses.replace(md, entries={**md.entries, "extra": BytesEntry()})
    with pytest.raises(CheckpointError) as err:
        check_metadata(md, "x/.metadata")
    message = str(err.value)
    assert "2 problem(s)" in message
    assert "cover 12 of 24" in message and "extra (byte item): no storage record" in message


# --- writing what torch reads ------------------------------------------------------------------


def test_written_checkpoint_loads_with_torch_dcp_load(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    want = {
        "w": torch.randn(6, 4, generator=gen),
        "emb": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        "s": torch.tensor(-1.25),
    }
    meta_obj = {"iteration": 3}
    # "w" in two row chunks in two files, as two ranks would store it.
    pieces = {
        "__0_0.distcp": [("w", (0, 0), want["w"][:4]), ("emb", (0, 0), want["emb"])],
        "__1_0.distcp": [("w", (4, 0), want["w"][4:]), ("s", (), want["s"])],
    }
    out = tmp_path / "ours"
    out.mkdir()
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    for name, items in pieces.items():
        with open(out / name, "wb") as f:
            if name == "__0_0.distcp":
                buf = io.BytesIO()
                torch.save(meta_obj, buf)
                storage[("meta", None)] = write_bytes_record(f, name, buf.getvalue())
            for fqn, offsets, t in items:
                slot = TensorSlot(fqn, t.dtype, tuple(t.shape))
                storage[(fqn, offsets)] = write_tensor_record(
                    f, name, slot, lambda _s, t=t: [raw_bytes(from_torch(t))]
                )

    def chunks(fqn: str) -> tuple[Chunk, ...]:
        return tuple(
            Chunk(offsets=o, sizes=tuple(t.shape))
            for items in pieces.values()
            for f, o, t in items
            if f == fqn
        )

    entries: dict[str, TensorEntry | BytesEntry] = {
        fqn: TensorEntry(
            dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), chunks=chunks(fqn)
        )
        for fqn, t in want.items()
    }
    entries["meta"] = BytesEntry()
    md = DcpMetadata(entries=entries, storage=storage, version=DCP_VERSION)
    (out / METADATA_FILE).write_bytes(metadata_bytes(md))

    # torch reads it: its own loader, its own unpickler, its own torch.load of each record.
    got: dict[str, Any] = {k: torch.empty_like(v) for k, v in want.items()}
    got["meta"] = 0
    dcp.load(got, checkpoint_id=out, no_dist=True)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(_bits(got[k]), _bits(v)), k
    assert got["meta"] == meta_obj

    # and we read it back unchanged (planner_data filled with flat key paths).
    flat = {fqn: (fqn,) for fqn in entries}
    assert _parse(out) == dataclasses.replace(md, planner_data=flat)
    info = storage[("w", (4, 0))]
    with open(out / info.relative_path, "rb") as f:
        alone = torch.load(RecordWindow(f, info.offset, info.length), weights_only=True)
    assert torch.equal(alone, want["w"][4:])


def _built_by_torch(md: DcpMetadata) -> tmd.Metadata:
    """``md`` built from torch's own DCP classes: what torch's saver would pickle."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def entry(e: TensorEntry | BytesEntry) -> Any:
        if isinstance(e, BytesEntry):
            return tmd.BytesStorageMetadata()
        return tmd.TensorStorageMetadata(
            properties=tmd.TensorProperties(dtype=getattr(torch, e.dtype)),
            size=torch.Size(e.shape),
            chunks=[
                tmd.ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                for c in e.chunks
            ],
        )

    out = tmd.Metadata(
        state_dict_metadata={fqn: entry(e) for fqn, e in md.entries.items()},
        planner_data=dict(md.planner_data or {fqn: (fqn,) for fqn in md.entries}),
        storage_data={
            tmd.MetadataIndex(fqn, offsets): _StorageInfo(
                i.relative_path, i.offset, i.length, list(i.transform_descriptors) or None
            )
            for (fqn, offsets), i in md.storage.items()
        },
        version=md.version,
    )
    if md.save_info is not None:
        s = md.save_info
        out.storage_meta = tmd.StorageMeta(s.checkpoint_id, s.save_id, s.load_id, list(s.modules))
    return out


@pytest.mark.parametrize("with_save_info", [False, True])
def test_metadata_written_without_torch_unpickles_to_torchs_own(with_save_info: bool) -> None:
    """``.metadata`` is pickled without importing torch; torch unpickles it into exactly the
    ``Metadata`` its own classes build for the same checkpoint."""
    shape = (4, 6)
    boxes = [((0, 0), (2, 6)), ((2, 0), (2, 6))]
    entries: dict[str, TensorEntry | BytesEntry] = {
        f"t.{dtype}": TensorEntry(
            dtype=dtype,
            shape=shape,
            chunks=tuple(Chunk(offsets=o, sizes=s) for o, s in boxes),
        )
        for dtype in ("float32", "bfloat16", "float8_e4m3fn", "int64", "bool")
    }
    entries["scalar"] = TensorEntry(
        dtype="float32", shape=(), chunks=(Chunk(offsets=(), sizes=()),)
    )
    entries["meta"] = BytesEntry()
    storage: dict[Any, StorageInfo] = {}
    for fqn, e in entries.items():
        for c in e.chunks if isinstance(e, TensorEntry) else (None,):
            key = (fqn, None if c is None else c.offsets)
            storage[key] = StorageInfo(
                relative_path=f"__{len(storage) % 2}_0.distcp",
                offset=len(storage),
                length=7,
            )
    save_info = (
        SaveInfo(checkpoint_id="ckpt", save_id="s1", modules=("model",)) if with_save_info else None
    )
    md = DcpMetadata(
        entries=entries,
        storage=storage,
        planner_data={"meta": ("state", "meta")} | {k: (k,) for k in entries if k != "meta"},
        save_info=save_info,
        version=DCP_VERSION if with_save_info else None,
    )
    got = pickle.loads(metadata_bytes(md))
    assert type(got) is tmd.Metadata
    assert got == _built_by_torch(md)
    theirs = pickle.dumps(_built_by_torch(md), protocol=4)
    assert parse_metadata(metadata_bytes(md), "ours") == parse_metadata(theirs, "theirs")


def test_writer_refuses_metadata_with_problems() -> None:
    with pytest.raises(CheckpointError, match=r"refusing to write \.metadata: t: chunks cover"):
        metadata_bytes(_one_tensor((4, 6), [((0, 0), (2, 6))]))


# --- the allow-list itself ---------------------------------------------------------------------


def test_dtype_names_are_torch_dtypes_as_pickled() -> None:
    for name in DTYPE_NAMES:
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype) and dtype.__reduce__() == name


def test_reading_metadata_imports_no_torch() -> None:
    code = (
        "import sys, ckptctl.formats.dcp_container.metadata as m; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
