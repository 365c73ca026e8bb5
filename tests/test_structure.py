"""The shape of the code: one format interface (a new format is one folder), dependencies that
point one way with no cycles, a pure model without torch or fsspec, small modules."""

from __future__ import annotations

import ast
import json
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptctl.formats import registry
from tests.toyformat.format import FORMAT as TOY

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ckptctl", "planners")


@pytest.fixture
def toy() -> Iterator[None]:
    registry.register(TOY)
    yield
    registry.unregister(TOY.name)


def test_a_new_format_is_one_folder(toy, tmp_path: Path, cli) -> None:
    """The toy format lives in tests/toyformat/ alone; registered, every command handles it."""
    src = tmp_path / "npy"
    src.mkdir()
    tensors = {
        "embedding.weight": torch.randn(16, 8),
        "layer.bias": torch.randn(8).to(torch.bfloat16),
        "step": torch.tensor(3.0),
    }
    for name, value in tensors.items():
        np.save(
            src / f"{name}.npy",
            value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy(),
        )
    info = cli.json("inspect", src)
    assert info["format"] == "npy-dir" and info["tensors"] == 3
    assert "npy-dir" in {f["name"] for f in cli.json("formats")["formats"]}
    cli("consolidate", src, tmp_path / "one", "--format", "torch")
    loaded = torch.load(tmp_path / "one/state_dict.pt")
    assert set(loaded) == set(tensors)
    assert torch.equal(loaded["embedding.weight"], tensors["embedding.weight"])
    report = cli.json("verify", tmp_path / "one/state_dict.pt", "--against", src)
    assert report["ok"] and len(report["tensors"]) == 3
    checks = {c["name"]: c for c in cli.json("verify", src)["checks"]}
    assert checks["checksums"]["detail"] == "npy files carry no checksum"


def _imports(path: Path) -> set[str]:
    """Modules of the project (and top-level third-party names) a module imports at load time
    (imports inside functions are lazy on purpose and are not edges)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            continue
    return out


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def _all_imports(path: Path, modules: Collection[str]) -> set[str]:
    """The project's modules a module imports, at load time or lazily inside a function (not
    for type checking alone). ``from package import name`` is an edge to ``package.name``
    when that is a module. The root package ``ckptctl`` is no edge: it imports nothing when
    loaded, and only hands out the training API (``ckptctl.load``) on first use."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named = {f"{node.module}.{a.name}" for a in node.names}
            out |= (named & set(modules)) or {node.module}
    return {m for m in out if m in modules and m != "ckptctl"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _lazy_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _all_imports(path, modules) - {name} for name, path in sorted(modules.items())}


def test_there_are_no_import_cycles_at_load_time_or_lazy() -> None:
    assert not _cycles(_lazy_graph()), "import cycles"


def _package(module: str) -> str:
    """``planners``, or ``ckptctl.<package>`` (a top-level module is its own)."""
    parts = module.split(".")
    return parts[0] if parts[0] == "planners" else ".".join(parts[:2])


def test_packages_import_each_other_one_way() -> None:
    """No two packages import each other, directly or round about (lazy imports count)."""
    packages: dict[str, set[str]] = {}
    for module, imported in _lazy_graph().items():
        mine = packages.setdefault(_package(module), set())
        mine |= {_package(m) for m in imported} - {_package(module)}
    assert not _cycles(packages)


def _reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


FORBIDDEN = ("torch", "fsspec", "s3fs", "rich", "typer")


@pytest.mark.parametrize(
    "pure",
    [m for m in sorted(_modules()) if m.startswith(("planners", "ckptctl.model"))]
    + ["ckptctl.settings", "ckptctl.errors", "ckptctl.formats.support"],
)
def test_planners_and_the_pure_model_import_no_torch_fsspec_rich_or_typer(pure: str) -> None:
    graph = _graph()
    modules = _modules()
    for module in _reachable(pure, graph):
        third_party = {m.split(".")[0] for m in _imports(modules[module])}
        bad = third_party & set(FORBIDDEN)
        assert not bad, f"{pure} reaches {module}, which imports {sorted(bad)}"


def test_the_pure_layouts_of_formats_import_no_torch() -> None:
    graph = _graph()
    modules = _modules()
    for pure in (
        "ckptctl.formats.megatron_common.layout",
        "ckptctl.formats.megatron_common.target_style",
        "ckptctl.model.hf_layout",
        "ckptctl.formats.megatron_common.sharded_keys",
        "ckptctl.formats.dcp_container.metadata",
    ):
        for module in _reachable(pure, graph):
            assert "torch" not in {m.split(".")[0] for m in _imports(modules[module])}, module


LAYERS = {
    "ckptctl.model": ("ckptctl.io", "ckptctl.checksums", "ckptctl.formats", "ckptctl.pipeline"),
    "ckptctl.io": ("ckptctl.formats", "ckptctl.pipeline", "ckptctl.verify", "planners"),
    "ckptctl.checksums": ("ckptctl.formats", "ckptctl.pipeline", "ckptctl.verify", "planners"),
    "ckptctl.formats": ("ckptctl.pipeline", "ckptctl.verify", "planners"),
    "planners": (
        "ckptctl.io",
        "ckptctl.checksums",
        "ckptctl.formats",
        "ckptctl.pipeline",
        "ckptctl.verify",
    ),
}
"""What each package may not import: the pure model nothing with I/O; storage and checksums
no format or job; formats no job, check or policy; planners (policy) no I/O."""


def test_dependencies_point_one_way() -> None:
    """cli -> planners -> pure model; cli -> pipeline -> formats -> io / checksums; nothing
    below the CLI imports it, and no package imports one above it (``LAYERS``)."""
    graph = _graph()
    for module, imported in graph.items():
        if not module.startswith(("ckptctl.cli", "ckptctl.__main__")):
            assert not any(m.startswith("ckptctl.cli") for m in imported), module
        for package, above in LAYERS.items():
            if module == package or module.startswith(f"{package}."):
                wrong = sorted(m for m in imported if m.startswith(above))
                assert not wrong, f"{module} imports {wrong}"


def test_planners_import_only_the_pure_model() -> None:
    """Policy sees formats only through ``ckptctl.model.target``: a planner imports the model
    (and the error vocabulary), lazily or not, never a format, the pipeline or storage."""
    for module, imported in _lazy_graph().items():
        if not module.startswith("planners"):
            continue
        project = {m for m in imported if m.startswith("ckptctl")}
        wrong = sorted(m for m in project if not m.startswith(("ckptctl.model", "ckptctl.errors")))
        assert not wrong, f"{module} imports {wrong}"


def test_no_module_is_over_500_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert not long, long


def test_the_registry_is_the_only_list_of_formats() -> None:
    names = [f.name for f in registry.formats()]
    assert names == [
        "torch_dist",
        "dcp",
        "deepspeed-universal",
        "deepspeed",
        "verl",
        "accelerate",
        "megatron",
        "hf",
        "torch",
    ]
    for fmt in registry.formats():
        assert fmt.support is not None and fmt.support.name == fmt.name
    assert json.dumps([f.support.as_dict() for f in registry.formats()])


SHARED_FORMAT_MACHINERY = {
    "base",
    "registry",
    "support",
    "named",
    "safetensors_header",
    "torchsave",
    "target",
    "transformers_model",  # transformers' own description of an HF model it builds
    "hf_state_dict_files",  # HF-named torch.save state dicts (verl, accelerate)
    "shifted_reads",  # HF weights stored shifted from Megatron's (HF safetensors, DCP)
    "dcp_container",  # torch's DCP files: dcp, torch_dist
    "megatron_common",  # Megatron's rules: megatron, torch_dist, DCP in Megatron directories
    "options",  # the options several formats read (--hf-config, --trust-field, ...)
}
"""Modules and folders under ``ckptctl/formats`` that every format may import."""


def test_format_folders_import_no_other_format() -> None:
    """Each format folder imports only its own modules and the shared machinery, which imports
    no format folder: what two formats share (DCP's container, Megatron's rules) is a module of
    its own, never one format reaching into another."""
    found = set()
    for module, imported in _lazy_graph().items():
        if not module.startswith("ckptctl.formats."):
            continue
        folder = module.split(".")[2]
        for other in imported:
            parts = other.split(".")
            elsewhere = other.startswith("ckptctl.formats.") and parts[2] != folder
            if elsewhere and parts[2] not in SHARED_FORMAT_MACHINERY:
                found.add((module, other))
    assert not found, sorted(found)
