"""One test per bad input a new user and a fuzzer found handled badly (a crash, a hang, memory
blown, an internal error, or nonsense carried into an output), each now a one-line error with
exit 3 naming what is wrong. The programs run as ``python -m ckptctl``, forked from a warm
process under a timeout and a memory cap (``tests/oracle_runner.run_cli``), so a crash or a
hang fails the test instead of the suite. The fuzz suite (``test_fuzz.py``) covers these
families at large; here each finding is pinned with its message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckptctl import synth
from tests.fuzz import crafted, mutants
from tests.oracle_runner import run_cli

RANK0 = "iter_0000001/mp_rank_00_000/model_optim_rng.pt"
RANKS = [f"iter_0000001/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt" for t in (0, 1) for p in (0, 1)]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("untrusted")
    model = synth.make_model(synth.tiny_llama_config(num_layers=4), seed=3)
    synth.write_megatron(model, synth.adam_step(model, seed=3), root / "megatron", tp=2, pp=2)
    code, _, _, err = run_cli("consolidate", root / "megatron", root / "hf", timeout=120)
    assert code == 0, err
    code, _, _, err = run_cli(
        "reshard", root / "megatron", root / "torch_dist", "--pp", "1", "--format", "torch_dist"
    )
    assert code == 0, err
    (root / "hf" / "ckptctl.manifest.json").unlink()  # a foreign HF checkpoint
    import torch

    state = {"model": {n: p.detach().clone() for n, p in model.named_parameters()}}
    torch.distributed.checkpoint.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
    return {p.name: p for p in root.iterdir()}


def _refused(
    bases: dict[str, Path], tmp_path: Path, base: str, edit, message: str, command: str = "inspect"
) -> str:
    src = tmp_path / "src"
    shutil.copytree(bases[base], src, symlinks=True)
    edit(src)
    argv = {
        "inspect": ("inspect", src),
        "consolidate": ("consolidate", src, tmp_path / "out", "--format", "hf"),
        "reshard": ("reshard", src, tmp_path / "out", "--tp", "1", "--pp", "1"),
    }[command]
    code, timed_out, _, err = run_cli(*argv, timeout=30, memory_limit=2 << 30)
    assert not timed_out and code == 3, (code, err)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    assert message in lines[0], lines[0]
    assert not (tmp_path / "out" / "ckptctl.manifest.json").exists()
    return lines[0]


GEOMETRY = {
    "stride-negative": "negative size, stride or offset",  # was a segmentation fault
    "offset-negative": "negative size, stride or offset",
    "offset-past-end": "reaches byte",
    "stride-huge": "reaches byte",
    "shape-huge": "reaches byte",
}


@pytest.mark.parametrize("how", sorted(GEOMETRY))
def test_hostile_tensor_geometry(bases, tmp_path: Path, how: str) -> None:
    _refused(bases, tmp_path, "megatron", mutants.tensor_geometry(RANK0, how), GEOMETRY[how])


@pytest.mark.parametrize(
    ("kind", "message"),
    [("fifo", "is a FIFO"), ("zero", "character device"), ("urandom", "character device")],
)
def test_files_that_are_not_regular_files(bases, tmp_path: Path, kind: str, message: str) -> None:
    """A FIFO hung every command; a link to /dev/zero or /dev/urandom blew the memory up."""
    _refused(bases, tmp_path, "megatron", mutants.replace_with(RANK0, kind), message)
    shutil.rmtree(tmp_path / "src")
    _refused(bases, tmp_path, "hf", mutants.replace_with("model.safetensors", kind), message)


CONFIG = {
    "num_hidden_layers=1e9": ("num_hidden_layers", 1e9, "num_hidden_layers=1000000000.0"),
    "num_hidden_layers=10**9": ("num_hidden_layers", 10**9, "num_layers=1000000000 is implausible"),
    "num_attention_heads=0": ("num_attention_heads", 0, "num_attention_heads=0 is not a positive"),
    "vocab_size=10**12": ("vocab_size", 10**12, "is implausible"),
    "rope_theta string": ("rope_theta", "ten thousand", "rope_theta='ten thousand' is not"),
    "hidden_size string": ("hidden_size", "64", "hidden_size='64' is not a positive integer"),
}


@pytest.mark.parametrize("case", sorted(CONFIG))
def test_meaningless_hf_config_values(bases, tmp_path: Path, case: str) -> None:
    key, value, message = CONFIG[case]
    _refused(bases, tmp_path, "hf", mutants.json_field("config.json", key, value), message)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("a-list", "expected a JSON object, found a list"),
        ("null", "found null"),
        ("deep", "too deeply"),
    ],
)
def test_json_documents_of_the_wrong_shape(bases, tmp_path: Path, how: str, message: str) -> None:
    _refused(bases, tmp_path, "hf", mutants.json_document("config.json", how), message)
    shutil.rmtree(tmp_path / "src")
    edit = mutants.json_document("iter_0000001/metadata.json", how)
    _refused(bases, tmp_path, "torch_dist", edit, message)


HEADERS = {
    "offsets-float": "data_offsets must be a list of 2 non-negative integers",
    "offsets-three": "data_offsets must be a list of 2 non-negative integers",
    "offsets-missing": "data_offsets must be a list of 2 non-negative integers",
    "offsets-into-header": "data_offsets must be a list of 2 non-negative integers",
    "shape-string": "shape must be a list of non-negative integers",
    "overlap": "share bytes",
    "duplicate": "appears twice",
    "length-huge": "does not fit the file",
}


@pytest.mark.parametrize("how", sorted(HEADERS))
def test_hostile_safetensors_headers(bases, tmp_path: Path, how: str) -> None:
    edit = mutants.safetensors_header("model.safetensors", how)
    _refused(bases, tmp_path, "hf", edit, HEADERS[how], command="consolidate")


ARGS = {
    "num_layers=10**9": ("num_layers", 10**9, "num_layers=1000000000 is implausible"),
    "num_layers string": ("num_layers", "4", "num_layers"),
    "num_layers float": ("num_layers", 4.0, "num_layers"),
    "iteration=-1": ("iteration", -1, "iteration=-1 is not an iteration number"),
    "iteration string": ("iteration", "x", "iteration='x' is not an iteration number"),
    "iteration=2**80": ("iteration", 2**80, "is not an iteration number"),
    "iteration None": ("iteration", None, "iteration=None is not an iteration number"),
    "world_size disagrees": ("data_parallel_size", 4, "args.world_size=4 is not tensor"),
}


@pytest.mark.parametrize("case", sorted(ARGS))
def test_meaningless_megatron_args_and_counters(bases, tmp_path: Path, case: str) -> None:
    """Values that were carried on silently into outputs (or blew the memory up)."""
    name, value, message = ARGS[case]
    edit = mutants.megatron_arg(RANKS, name, value, everywhere=True)
    _refused(bases, tmp_path, "megatron", edit, message, command="reshard")


@pytest.mark.parametrize(
    ("value", "message"),
    [(b"9" * 5000, "larger than 1024 bytes"), (b"\xff\xfe\x00\x01", "not UTF-8")],
)
def test_trackers_that_are_no_iteration(bases, tmp_path: Path, value: bytes, message: str) -> None:
    _refused(bases, tmp_path, "megatron", mutants.tracker(value), message)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("a-list", "'model' holds a list, not a state dict"),
        ("numpy-object", "not a state dict"),
        ("shared-bomb", "pickle bomb"),
        ("bytearray-3GiB", "bytearray(int)"),
    ],
)
def test_hostile_values_in_rank_files(bases, tmp_path: Path, how: str, message: str) -> None:
    value = mutants.HOSTILE_VALUES[how]
    key = ("opt_param_scheduler",) if how in ("shared-bomb", "bytearray-3GiB") else ("model",)
    _refused(bases, tmp_path, "megatron", mutants.pickled_value(RANK0, key, value), message)


def test_a_whole_rank_file_that_is_a_list(bases, tmp_path: Path) -> None:
    def edit(root: Path) -> None:
        crafted.save([1, 2, 3], root / RANKS[1])

    _refused(bases, tmp_path, "megatron", edit, "holds a list, not a rank file")


def test_a_pickle_nested_200000_deep(bases, tmp_path: Path) -> None:
    edit = mutants.raw_pickle(RANK0, crafted.deep_list_pickle(200_000))
    _refused(bases, tmp_path, "megatron", edit, "nests containers more than 256 deep")


def test_a_bomb_in_dcp_planner_data(bases, tmp_path: Path) -> None:
    _refused(bases, tmp_path, "dcp", mutants.dcp_metadata(".metadata", "planner-bomb"), "bomb")


def test_a_dcp_metadata_dtype_that_disagrees_with_the_records(bases, tmp_path: Path) -> None:
    """``verify`` passed it and ``consolidate`` then refused it: now ``verify`` fails first."""
    src = tmp_path / "src"
    shutil.copytree(bases["dcp"], src)
    mutants.dcp_metadata(".metadata", "dtype-disagrees")(src)
    code, _, out, _ = run_cli("verify", src, "--json", timeout=60)
    report = json.loads(out)
    tensors = next(c for c in report["checks"] if c["name"] == "tensors")
    assert code == 1 and tensors["status"] == "failed" and ".metadata promises" in tensors["detail"]
    code, _, _, err = run_cli("consolidate", src, tmp_path / "t", "--format", "torch", timeout=60)
    assert code == 3 and ".metadata promises" in err


def test_bytearray_costs_no_memory(bases, tmp_path: Path) -> None:
    """A 1 MB file rebuilt a 3 GiB bytearray: under a 2 GiB cap the run is refused cleanly."""
    value = mutants.HOSTILE_VALUES["bytearray-3GiB"]
    edit = mutants.pickled_value(RANK0, ("opt_param_scheduler",), value)
    _refused(bases, tmp_path, "megatron", edit, "bytearray(int)", command="reshard")
