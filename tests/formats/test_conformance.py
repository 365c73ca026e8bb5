"""What every registered format must do, parametrised over the registry (issue 53's
conformance suite): a box ckptctl reads is torch's own slice of the same stored tensor (loaded by
torch, safetensors or DCP, not by ckptctl); what ckptctl writes in the format reads back bit for
bit; a flipped byte fails ``verify``; a truncated file is refused with exit code 3.

One sample checkpoint per format: Megatron legacy written by the independent generator
(``ckptctl.synth``), DeepSpeed ZeRO by DeepSpeed itself (``tests/deepspeed_runs.py``), DCP by
``torch.distributed.checkpoint.save``; the formats ckptctl writes (``torch_dist``, HF,
DeepSpeed universal, one torch file) by ckptctl from those. The test-only toy format
(``tests/toyformat``: ``.npy`` files) is registered for this module and passes the same suite
as a source and as a target, its sample written by ckptctl and its boxes compared with numpy's
own ``np.load``. A format added to the registry without a sample here fails
``test_every_registered_format_has_a_sample``.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl import synth
from ckptctl.formats import registry
from ckptctl.pipeline.probe import open_checkpoint
from tests.conftest import Cli
from tests.deepspeed_runs import write_runs
from tests.oracle_runner import run_oracle
from tests.toyformat.format import FORMAT as TOY

BOXES_PER_TENSOR = 2
TENSORS_PER_FORMAT = 40
"""Stored tensors whose boxes are compared, per format (spread over its files)."""


REGISTERED = sorted({*(f.name for f in registry.formats()), TOY.name})
"""Every built-in format and the toy one (registered for this module by ``toy``)."""


@pytest.fixture(scope="module", autouse=True)
def toy() -> Iterator[None]:
    registry.register(TOY)
    yield
    registry.unregister(TOY.name)


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory, mcli: Cli) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conformance")
    config = synth.tiny_llama_config(num_layers=4)
    model = synth.make_model(config, seed=5)
    states = synth.adam_step(model, seed=6)
    megatron = root / "megatron"
    synth.write_megatron(model, states, megatron, tp=2, pp=2)
    out = {"megatron": megatron}
    out["torch_dist"] = root / "torch_dist"
    mcli("reshard", megatron, out["torch_dist"], "--format", "torch_dist", "--tp", "2")
    out["hf"] = root / "hf"
    mcli("consolidate", megatron, out["hf"], "--format", "hf")
    out["deepspeed-universal"] = root / "universal"
    mcli("consolidate", megatron, out["deepspeed-universal"], "--format", "deepspeed-universal")
    dcp = root / "dcp"
    import torch.distributed.checkpoint as dcp_api

    dcp_api.save({k: v.clone() for k, v in model.state_dict().items()}, checkpoint_id=str(dcp))
    config.to_json_file(str(dcp / "config.json"))
    out["dcp"] = dcp
    out["torch"] = root / "torch"
    mcli("consolidate", dcp, out["torch"], "--format", "torch")
    out["deepspeed"] = write_runs(tmp_path_factory)["stage2-dp2"]
    run_oracle("verl_fsdp_writer.py", "qwen3", root / "verl", 3, timeout=300)
    out["verl"] = root / "verl" / "global_step_1" / "actor"
    run_oracle("accelerate_fsdp_writer.py", root / "accelerate", "FULL_STATE_DICT", timeout=300)
    shutil.copy(root / "accelerate" / "config.json", root / "accelerate" / "state")
    out["accelerate"] = root / "accelerate" / "state"
    out[TOY.name] = root / "npy"
    mcli("consolidate", dcp, out[TOY.name], "--format", TOY.name)
    return out


def test_every_registered_format_has_a_sample(samples: dict[str, Path]) -> None:
    assert {f.name for f in registry.formats()} == set(samples)


# --- a box read is torch's own slice ----------------------------------------------------------


def _torch_tensor(fmt: str, root: Path, path: str, key: tuple[Any, ...], cache: dict) -> Any:
    """The stored tensor at ``key`` of ``path``, loaded by torch's (or safetensors', or DCP's)
    own reader, as it lies in the file (a DCP record: the chunk at the key's offsets)."""
    file = root / path
    if fmt == TOY.name:
        import numpy as np

        return torch.from_numpy(np.load(file))
    if fmt == "hf":
        from safetensors.torch import load_file

        if file not in cache:
            cache[file] = load_file(str(file))
        return cache[file][str(key[0])]
    if fmt in ("dcp", "torch_dist"):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        directory = file.parent
        if directory not in cache:
            whole = cache["scratch"] / f"{len(cache)}.pt"  # never inside the sample
            dcp_to_torch_save(str(directory), str(whole))
            cache[directory] = torch.load(whole, weights_only=False)
        return cache[directory][str(key[0])]
    if file not in cache:
        cache[file] = torch.load(file, weights_only=False, map_location="cpu")
    node = cache[file]
    for part in key:  # a DTensor's local shard (verl's rank files) is an attribute
        node = node._local_tensor if part == "_local_tensor" else node[part]
    return node


def _stored(fmt: str, tensor: Any, held: Any) -> Any:
    """The part of the loaded tensor that ckptctl's stored tensor ``held`` describes."""
    if fmt in ("dcp", "torch_dist"):
        offsets = [int(k) for k in held.key[1:]]
        lead = len(offsets) - len(held.shape)
        sizes = (*(1,) * lead, *held.shape)
        box = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        return box.reshape(held.shape)
    if held.view_offset is not None:
        count = 1
        for size in held.shape:
            count *= size
        return tensor.reshape(-1)[held.view_offset : held.view_offset + count].reshape(held.shape)
    return tensor


def _bytes(value: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return value.tobytes()


@pytest.mark.parametrize("fmt", REGISTERED)
def test_a_box_read_is_torchs_own_slice(fmt: str, samples: dict[str, Path], tmp_path: Path) -> None:
    root = samples[fmt]
    ckpt = open_checkpoint(str(root))
    rng = random.Random(fmt)
    held = [
        (file.path, t)
        for file in ckpt.view.files
        for t in file.tensors
        if t.shape and not t.transposed and (fmt not in ("dcp", "torch_dist") or not t.view_offset)
    ]
    assert held, f"{fmt}: no stored tensors"
    cache: dict = {"scratch": tmp_path}
    for path, t in rng.sample(held, min(TENSORS_PER_FORMAT, len(held))):
        whole = _stored(fmt, _torch_tensor(fmt, root, path, t.key, cache), t)
        assert tuple(whole.shape) == tuple(t.shape), (path, t.key)
        view = None if t.view_offset is None else (t.view_offset, t.shape)
        for _ in range(BOXES_PER_TENSOR):
            offsets = tuple(rng.randrange(size) for size in t.shape)
            sizes = tuple(rng.randint(1, n - o) for o, n in zip(offsets, t.shape, strict=True))
            got = ckpt.read(path, t.key, offsets, sizes, view)
            want = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
            assert tuple(got.shape) == sizes, (path, t.key)
            assert _bytes(got) == _bytes(want), (path, t.key, offsets, sizes)


# --- what ckptctl writes reads back; damage is caught -----------------------------------------

WRITTEN = ("megatron", "torch_dist", "hf", "deepspeed-universal", "torch", "verl", TOY.name)
"""Formats ckptctl writes (their samples above are its own outputs, with manifests)."""


def test_the_formats_written_are_the_registrys_writers() -> None:
    assert {f.name for f in registry.formats() if f.writers} == set(WRITTEN)


@pytest.mark.parametrize("fmt", WRITTEN)
def test_written_then_read_again_is_bit_for_bit(
    fmt: str, samples: dict[str, Path], mcli: Cli, tmp_path: Path
) -> None:
    """The sample rewritten by ckptctl in its own format (the same layout) holds the same
    tensors bit for bit, each compared (``verify --against``)."""
    again = tmp_path / "again"
    command = "reshard" if fmt in ("megatron", "torch_dist", "verl") else "consolidate"
    # verl's files are sharded over data parallelism alone: a "full" source cut again
    strategy = "full-then-split" if fmt == "verl" else "shard-to-shard"
    extra = ("--format", fmt) if command == "consolidate" else ("--strategy", strategy)
    mcli(command, samples[fmt], again, *extra)
    report = mcli.json("verify", again, "--against", samples[fmt])
    against = next(c for c in report["checks"] if c["name"] == "against")
    assert against["status"] == "passed", against
    assert " equal to " in against["detail"], against


def _copy_and_its_largest_file(sample: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``sample`` to damage, and its largest data file (not ckptctl's own)."""
    copy = tmp_path / "copy"
    shutil.copytree(sample, copy)
    files = [p for p in copy.rglob("*") if p.is_file() and not p.name.startswith("ckptctl.")]
    return copy, max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("fmt", WRITTEN)
def test_a_flipped_byte_fails_verify(
    fmt: str, samples: dict[str, Path], mcli: Cli, tmp_path: Path
) -> None:
    copy, victim = _copy_and_its_largest_file(samples[fmt], tmp_path)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    result = mcli("verify", copy, code=1)
    assert victim.name in result.stdout + result.stderr


@pytest.mark.parametrize("fmt", REGISTERED)
def test_a_truncated_file_is_refused_with_exit_3(
    fmt: str, samples: dict[str, Path], mcli: Cli, tmp_path: Path
) -> None:
    copy, victim = _copy_and_its_largest_file(samples[fmt], tmp_path)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    out = tmp_path / "out"
    target = "torch" if fmt in ("dcp", "torch_dist", "torch") else "hf"
    result = mcli("consolidate", copy, out, "--format", target, code=3)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert victim.name in lines[0], lines[0]
    assert not (out / "ckptctl.manifest.json").exists()
