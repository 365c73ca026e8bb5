"""Generate ckptctl's table of Megatron-LM's arguments, per release: each argument's default,
and the fields ``validate_args`` derives, as Megatron-LM's own parser gives them.

ckptctl judges the ``args`` a Megatron checkpoint carries by value: a field at its release's
default (or derived by ``validate_args``) leaves the model what its mapped fields say, so it is
accepted without being known by name (``ckptctl/formats/megatron_common/release_args.py`` reads the
table). The table is data about Megatron-LM, made by running its parser, never its code copied:

    python tools/megatron_release_args.py MEGATRON_LM_GIT_DIR PYTHON > \\
        ckptctl/formats/megatron_common/release_args.json

The table holds, for every field any release's parser has, each value a release gives it by
default, and which fields ``validate_args`` derives (their values depend on the model, so only
their names are kept).
``MEGATRON_LM_GIT_DIR`` is a clone of https://github.com/NVIDIA/Megatron-LM with its release
tags; ``PYTHON`` an interpreter with torch (and Python >= 3.10; the megatron-core 0.19.2
environment of the tests serves). Each release's ``megatron/`` is exported from its tag into a
temporary directory and its ``parse_args`` run there, with the smallest model arguments it
requires, then ``validate_args`` on one rank; a release whose parser cannot be imported is
reported on stderr and left out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RELEASES = (
    "core_r0.12.0",
    "core_v0.12.3",
    "core_v0.13.1",
    "core_v0.14.0",
    "core_v0.15.3",
    "core_v0.16.1",
    "core_v0.17.1",
    "core_v0.18.2",
    "core_v0.19.0",
)

PROBE = r"""
import enum, json, os, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", TORCH_CUDA_ARCH_LIST="8.0")
import torch

def plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return {"torch.dtype": str(value).removeprefix("torch.")}
    if isinstance(value, enum.Enum):
        kind = f"{type(value).__module__}.{type(value).__name__}"
        return {"enum": kind, "value": plain(value.value)}
    return {"repr": type(value).__name__}

sys.argv = ["megatron", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--vocab-size", "1000", "--tokenizer-type", "NullTokenizer"]
from megatron.training import arguments
args = arguments.parse_args(ignore_unknown_args=True)
defaults = {k: plain(v) for k, v in sorted(vars(args).items())}
derived = {}
try:
    arguments.validate_args(args, {})
    after = {k: plain(v) for k, v in sorted(vars(args).items())}
    derived = {k: v for k, v in after.items() if k not in defaults or v != defaults[k]}
except Exception as err:  # noqa: BLE001 - reported, the defaults still stand
    print(f"validate_args: {type(err).__name__}: {err}", file=sys.stderr)
print(json.dumps({"defaults": defaults, "derived": derived}))
"""


def release(repo: Path, python: str, tag: str) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", f"--git-dir={repo}", "archive", tag, "megatron"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        done = subprocess.run(
            [python, "-c", PROBE, tmp], capture_output=True, text=True, cwd=tmp, timeout=600
        )
        if done.returncode != 0:
            print(f"{tag}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        if done.stderr.strip():
            print(f"{tag}: {done.stderr.strip().splitlines()[-1]}", file=sys.stderr)
        return json.loads(done.stdout.strip().splitlines()[-1])


def installed(python: str) -> tuple[str, dict] | None:
    """The release installed beside ``python`` (a megatron-core wheel ships
    ``megatron/training``), by its version."""
    version = subprocess.run(
        [python, "-c", "from megatron.core.package_info import __version__; print(__version__)"],
        capture_output=True,
        text=True,
    )
    if version.returncode != 0:
        return None
    with tempfile.TemporaryDirectory() as empty:
        done = subprocess.run(
            [python, "-c", PROBE, empty], capture_output=True, text=True, cwd=empty, timeout=600
        )
    if done.returncode != 0:
        return None
    return f"core_v{version.stdout.strip()} (wheel)", json.loads(
        done.stdout.strip().splitlines()[-1]
    )


def main() -> None:
    repo, python = Path(sys.argv[1]), sys.argv[2]
    found: dict[str, dict] = {}
    for tag in RELEASES:
        probed = release(repo, python, tag)
        if probed is not None:
            found[tag] = probed
    wheel = installed(python)
    if wheel is not None:
        found[wheel[0]] = wheel[1]
    values: dict[str, list] = {}
    derived: set[str] = set()
    for tag, probed in found.items():
        print(f"{tag}: {len(probed['defaults'])} fields", file=sys.stderr)
        # A derived value is the probe model's, not a default: only its name is kept (every
        # derived field is classified by name in args_fields.py).
        for name, value in probed["defaults"].items():
            seen = values.setdefault(name, [])
            if value not in seen:
                seen.append(value)
        derived.update(probed["derived"])
    table = {
        "generated_by": "tools/megatron_release_args.py",
        "probe": "parse_args, then validate_args on one rank, of the smallest GPT model",
        "releases": {tag: len(probed["defaults"]) for tag, probed in found.items()},
        "values": dict(sorted(values.items())),
        "derived": sorted(derived),
    }
    json.dump(table, sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
