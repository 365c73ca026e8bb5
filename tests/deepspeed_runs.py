"""DeepSpeed runs the DeepSpeed tests share (issue 16): written once per session by DeepSpeed
0.19.8 itself on CPU (``tests/oracles/deepspeed_zero.py``), and DeepSpeed's own tools' view of
them (``zero_to_fp32``, ``ds_to_universal``) to judge ckptctl by; the runs and zero_to_fp32's
outputs are kept between sessions (``tests/oracle_cache``). On CPU the first DeepSpeed run
compiles a communication op (about 90 s, cached under ~/.cache/ckptctl-oracles/torch_extensions,
see ``fork_server._build_deepspeed_ops``)."""

from __future__ import annotations

import shutil
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from ckptctl.arrays import to_torch
from tests import oracle_cache
from tests.oracle_runner import OracleFailed, run_module, run_oracle

ORACLE = "deepspeed_zero.py"
RUNS = {
    "stage2-dp2": ("2", "2", "fp32"),
    "stage1-dp2": ("1", "2", "fp32"),
    "stage2-dp4": ("2", "4", "fp32"),
    # bf16 weights, fp32 masters: the same ZeRO keys in bf16_zero_pp_rank_* files
    "stage2-bf16-dp2": ("2", "2", "bf16"),
    # every parameter partitioned on its own; DP 3 pads the last rank's share of each
    "stage3-dp2": ("3", "2", "fp32"),
    "stage3-bf16-dp3": ("3", "3", "bf16"),
    # every parameter trained: what a Megatron target (whose optimizer holds all) can take
    "stage2-bf16-dp2-all": ("2", "2", "bf16", "--no-frozen"),
    # bf16 with fp32 gradient accumulation at stage 1: DeepSpeed's BF16_Optimizer, which
    # zero_to_fp32 refuses ("not a zero checkpoint"); ds_to_universal is the judge
    "bf16-optimizer-dp2": ("1", "2", "bf16", "--fp32-grad-accum"),
}
ZERO_TO_FP32_RUNS = [r for r in RUNS if "--fp32-grad-accum" not in RUNS[r]]


def oracle(*args: object) -> None:
    try:
        run_oracle(ORACLE, *args, timeout=900, flavour="deepspeed")
    except OracleFailed as failed:
        lines = [line for line in str(failed).splitlines() if "Warning" not in line]
        raise OracleFailed("\n".join(lines[-30:])) from None


def kept_oracle(folder: Path, *args: object) -> None:
    """``oracle(*args)``, which writes under ``folder`` only, or its files from an earlier
    session's run of the same source, environment and inputs (``tests/oracle_cache``)."""
    environment = f"deepspeed {version('deepspeed')} torch {torch.__version__}"
    run_key = oracle_cache.key(folder, [ORACLE, *map(str, args)], environment)
    oracle_cache.run_once(folder, run_key, lambda: oracle(*args))


_WRITTEN: dict[str, Path] = {}
# kept past the module that wrote them (tests/conftest.py removes the rest at its end)
SHARED_PREFIX = "shared-"


def write_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every run of ``RUNS`` written by DeepSpeed (and read by zero_to_fp32), once per test
    session: the test modules' ``written`` fixtures share them."""
    if _WRITTEN:
        return _WRITTEN
    root = tmp_path_factory.mktemp(f"{SHARED_PREFIX}deepspeed")
    out: dict[str, Path] = {}
    for name, (stage, dp, dtype, *flags) in RUNS.items():
        args = ("write", root / name, "--stage", stage, "--dp", dp, "--dtype", dtype, *flags)
        try:
            kept_oracle(root, *args)
        except AssertionError as err:
            # gloo on CPU now and then aborts a process ("terminate called without an active
            # exception"): DeepSpeed's harness, not what is under test; one more try.
            if "without an active exception" not in str(err):
                raise
            shutil.rmtree(root / name, ignore_errors=True)
            kept_oracle(root, *args)
        out[name] = root / name
    # DeepSpeed's own zero_to_fp32 of each, in one process (its import is most of one run)
    pairs = [(out[name], root / f"{name}.fp32.pt") for name in ZERO_TO_FP32_RUNS]
    kept_oracle(root, "fp32", *(path for pair in pairs for path in pair))
    _WRITTEN.update(out)
    return _WRITTEN


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The runs, for a test module (``written = runs.written``)."""
    return write_runs(tmp_path_factory)


def by_hf_name(path: Path, state: str) -> dict[str, torch.Tensor]:
    """Every HF parameter's weight (``state`` empty) or Adam state as ckptctl reads it: stored
    fragments placed into canonical tensors, canonical tensors cut into HF names."""
    from ckptctl.model.catalog import parameters, state_name
    from ckptctl.model.hf_layout import hf_tensors
    from ckptctl.pipeline.probe import open_checkpoint

    ckpt = open_checkpoint(str(path))
    spec = ckpt.view.spec
    wanted = {
        (state_name(state, p.name) if state else p.name): torch.full(p.shape, float("nan"))
        for p in parameters(spec)
    }
    for file in ckpt.view.files:
        for t in file.tensors:
            if t.canonical not in wanted:
                continue
            view = None if t.view_offset is None else (t.view_offset, t.shape)
            data = to_torch(ckpt.read(file.path, t.key, (0,) * len(t.shape), t.shape, view))
            for p in t.pieces:
                dst = tuple(slice(o, o + n) for o, n in zip(p.canonical, p.sizes, strict=True))
                src = tuple(slice(o, o + n) for o, n in zip(p.local, p.sizes, strict=True))
                wanted[state_name(state, t.canonical.split("/")[-1]) if state else t.canonical][
                    dst
                ] = data[src].float()
    out = {}
    for hf, canonical, shape, pieces in hf_tensors(spec):
        full = wanted[state_name(state, canonical) if state else canonical]
        tensor = torch.empty(shape)
        for p in pieces:
            dst = tuple(slice(o, o + n) for o, n in zip(p.local, p.sizes, strict=True))
            src = tuple(slice(o, o + n) for o, n in zip(p.canonical, p.sizes, strict=True))
            tensor[dst] = full[src]
        out[hf] = tensor
    return out


_UNIVERSAL: dict[str, Path] = {}


def ds_universal(ckpt: Path) -> Path:
    """DeepSpeed's own ds_to_universal output for a run (made once per test session)."""
    if str(ckpt) not in _UNIVERSAL:
        out = ckpt.parent / f"{ckpt.name}.universal"
        run_module(
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder", ckpt / "global_step2", "--output_folder", out,
            "--inject_missing_state",
            flavour="deepspeed",
        )  # fmt: skip
        _UNIVERSAL[str(ckpt)] = out
    return _UNIVERSAL[str(ckpt)]


def universal_state(ckpt: Path, name: str, state: str) -> torch.Tensor | None:
    """One state of one parameter as ds_to_universal extracted it (None: not written)."""
    path = ds_universal(ckpt) / "zero" / name / f"{state}.pt"
    if not path.exists():
        return None
    value = torch.load(path, weights_only=False)
    return value["param"] if isinstance(value, dict) else value


FROZEN = "model.layers.0.mlp.down_proj.weight"


def load_universal(universal: Path, out: Path, stage: str, dp: str, dtype: str) -> dict:
    oracle("load-universal", universal, out, "--stage", stage, "--dp", dp, "--dtype", dtype)
    return torch.load(out, weights_only=False)
