"""The bipartite overlap graph of a plan: source files on one side, target files on the other,
edges weighted by the bytes moving between them. Kept behind this module's own small API so
networkx types never leak out. Pure."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from ckptctl.plan import Plan

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class Transfers:
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    bytes: dict[tuple[str, str], int]
    """(source file, target file) -> bytes copied between them."""

    def fan_in(self, target: str) -> int:
        """How many source files feed ``target``."""
        return sum(1 for (_, t) in self.bytes if t == target)


def overlap_graph(plan: Plan) -> Transfers:
    graph = nx.Graph()
    for file in plan.files:
        graph.add_node(("target", file.path), bipartite=1)
        for tensor in file.tensors:
            size = _ITEMSIZE.get(tensor.dtype, 4)
            for copy in tensor.copies:
                n = size
                for dim in copy.sizes:
                    n *= dim
                src = ("source", plan.source_files[copy.source])
                graph.add_node(src, bipartite=0)
                edge = graph.get_edge_data(src, ("target", file.path), {"bytes": 0})
                graph.add_edge(src, ("target", file.path), bytes=edge["bytes"] + n)
        if file.copy_of is not None:
            src = ("source", plan.source_files[file.copy_of])
            graph.add_edge(src, ("target", file.path), bytes=1)
    sources = tuple(sorted(n[1] for n, d in graph.nodes(data=True) if d.get("bipartite") == 0))
    targets = tuple(f.path for f in plan.files)
    weights = {
        (a[1], b[1]) if a[0] == "source" else (b[1], a[1]): w
        for a, b, w in graph.edges(data="bytes")
    }
    return Transfers(sources, targets, weights)
