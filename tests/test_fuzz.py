"""The clean-error contract under a structure-aware fuzzer.

Every mutant of ``tests/fuzz/mutants.py`` (a few hundred, seeded) goes through ``inspect``,
``verify``, ``consolidate --format hf`` and ``reshard --tp 1 --pp 1``, each the real program
(``python -m ckptctl``, forked from a warm process) under a timeout and a cap on memory. The
contract, for every command on every mutant:

* it ends by itself (no timeout) with an exit code, not a signal, within the memory cap;
* the code is 0, 2 (usage) or 3 (bad checkpoint), or 1 from ``verify`` (a check failed);
* a failure is one ``error:`` line; never a traceback, never an "internal error";
* the mutant's files are untouched;
* ``verify`` fails whatever ``consolidate`` or ``reshard`` then refuses as a bad checkpoint
  (exit 3): it checks at least what the readers check;
* a mutant that leaves nothing meaningful (hostile geometry or pickles, meaningless counters,
  JSON of the wrong shape, odd file types: ``Mutant.must_refuse``) is failed by ``verify`` and
  refused by every conversion, never carried into an output.

Bases are written by ckptctl's writers (with and without their manifest) and by torch's DCP.
"""

from __future__ import annotations

import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ckptctl import synth
from tests.fuzz.mutants import Mutant, mutants
from tests.oracle_runner import run_cli

SEED = int(os.environ.get("CKPTCTL_FUZZ_SEED", "51"))
TIMEOUT = 20.0
MEMORY = 2 << 30
SLOTS = 2


def _cli(*args: object) -> None:
    code, timed_out, out, err = run_cli(*args, timeout=120)
    assert code == 0 and not timed_out, (args, out, err)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz-bases")
    model = synth.make_model(synth.tiny_llama_config(num_layers=4), seed=51)
    megatron = root / "megatron"
    states = synth.adam_step(model, seed=51)
    synth.write_megatron(model, states, megatron, tp=2, pp=2)
    distopt = root / "megatron_distopt"
    synth.write_megatron(model, states, distopt, tp=1, pp=2, dp=2, distributed_optimizer=True)
    _cli(
        "reshard", megatron, root / "torch_dist", "--tp", "2", "--pp", "1", "--format", "torch_dist"
    )
    _cli("consolidate", megatron, root / "hf")
    _cli("consolidate", megatron, root / "hf_sharded", "--max-shard-size", "64KiB")
    _cli("consolidate", root / "torch_dist", root / "torch", "--format", "torch")
    for name in ("torch_dist", "hf_sharded", "torch"):  # as the training tools leave them
        (root / name / "ckptctl.manifest.json").unlink()
    dcp = root / "dcp"
    state = {"model": {n: p.detach().clone() for n, p in model.named_parameters()}}
    torch.distributed.checkpoint.save(state, checkpoint_id=str(dcp), no_dist=True)
    return {p.name: p for p in root.iterdir()}


def _digest(root: Path) -> dict[str, str]:
    """What each entry is and holds, without opening FIFOs or following links."""
    out = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        rel = str(path.relative_to(root))
        if stat.S_ISREG(info.st_mode):
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif stat.S_ISLNK(info.st_mode):
            out[rel] = "link:" + os.readlink(path)
        else:
            out[rel] = f"mode:{stat.S_IFMT(info.st_mode)}"
    return out


@dataclass
class Outcome:
    mutant: str
    runs: dict[str, tuple[int, bool, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


COMMANDS = {
    "inspect": lambda src, dst: ("inspect", src),
    "verify": lambda src, dst: ("verify", src),
    "consolidate": lambda src, dst: ("consolidate", src, dst / "hf", "--format", "hf"),
    "reshard": lambda src, dst: ("reshard", src, dst / "tp1", "--tp", "1", "--pp", "1"),
}


def _judge(name: str, code: int, timed_out: bool, err: str) -> list[str]:
    problems = []
    if timed_out:
        return [f"{name}: no answer within {TIMEOUT:.0f} s"]
    if code < 0:
        return [f"{name}: killed by signal {-code}"]
    allowed = {0, 1, 2, 3} if name == "verify" else {0, 2, 3}
    if code not in allowed:
        problems.append(f"{name}: exit {code}")
    if "Traceback" in err:
        problems.append(f"{name}: traceback: {err.strip().splitlines()[-1][:200]}")
    if "internal error" in err:
        problems.append(f"{name}: {err.strip()[:240]}")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if len(errors) > 1 or (code not in (0, 1) and len(errors) != 1):
        problems.append(f"{name}: {len(errors)} error lines (exit {code}): {err.strip()[:200]}")
    return problems


def _run(mutant: Mutant, bases: dict[str, Path], root: Path, slot: int) -> Outcome:
    outcome = Outcome(mutant.name)
    try:
        src = mutant.make(bases, root / "src")
    except Exception as err:  # the suite's own bug: reported with the rest
        outcome.problems.append(f"the suite could not make it: {err!r}")
        return outcome
    before = _digest(src)
    out_dir = root / "out" / src.name
    for name, argv in COMMANDS.items():
        dst = out_dir / name
        dst.mkdir(parents=True)
        code, timed_out, _, err = run_cli(
            *argv(src, dst), timeout=TIMEOUT, memory_limit=MEMORY, slot=slot
        )
        outcome.runs[name] = (code, timed_out, err.strip()[-300:])
        outcome.problems += _judge(name, code, timed_out, err)
    if _digest(src) != before:
        outcome.problems.append("the mutant's files changed")
    verify = outcome.runs["verify"][0]
    if mutant.must_refuse:
        passed = [name for name in COMMANDS if name != "inspect" and outcome.runs[name][0] == 0]
        if passed:
            outcome.problems.append(f"{', '.join(passed)} accepted it (exit 0)")
    for name in ("consolidate", "reshard"):
        if outcome.runs[name][0] == 3 and verify == 0:
            outcome.problems.append(
                f"verify passed what {name} refused: {outcome.runs[name][2][:200]}"
            )
    return outcome


def test_every_mutant_ends_in_a_clean_error_or_a_correct_result(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    cases = mutants(bases, SEED)
    assert len(cases) >= 250
    with ThreadPoolExecutor(SLOTS) as pool:
        outcomes = list(
            pool.map(lambda ic: _run(ic[1], bases, tmp_path, ic[0] % SLOTS), enumerate(cases))
        )
    failed = [o for o in outcomes if o.problems]
    report = "\n".join(f"{o.mutant}: {'; '.join(o.problems)}" for o in failed)
    assert not failed, f"{len(failed)} of {len(outcomes)} mutants broke the contract:\n{report}"
