"""The bipartite overlap graph of a plan: source files on one side, target files on the other,
edges weighted by the bytes moving between them. Kept behind this module's own small API so
networkx types never leak out. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.model.geometry import nbytes
from ckptctl.model.plan import Plan


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
    import networkx as nx  # 0.1 s to import: only when a plan is made

    graph = nx.Graph()
    for file in plan.files:
        graph.add_node(("target", file.path), bipartite=1)
        for tensor in file.tensors:
            for copy in tensor.copies:
                n = nbytes(copy.sizes, tensor.dtype)
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


def execution_order(plan: Plan) -> Plan:
    """Order the plan's writes as a task DAG: every file write before the commit files (written
    last, in order: the last one marks the checkpoint complete), and among writes, each next one
    chosen to share the most source files with the one before, so what was just read is still
    in the page cache or the read-ahead."""
    import networkx as nx  # 0.1 s to import: only when a plan is made

    graph = nx.DiGraph()
    reads: dict[int, set[int]] = {}
    for i, file in enumerate(plan.files):
        graph.add_node(("write", i))
        reads[i] = {c.source for t in file.tensors for c in t.copies}
        if file.copy_of is not None:
            reads[i].add(file.copy_of)
    for j in range(len(plan.finalize)):
        graph.add_node(("commit", j))
        for i in range(len(plan.files)):
            graph.add_edge(("write", i), ("commit", j))
        if j:
            graph.add_edge(("commit", j - 1), ("commit", j))
    order: list[tuple[str, int]] = []
    indegree = dict(graph.in_degree())
    ready = sorted(n for n, d in indegree.items() if d == 0)
    last: set[int] = set()
    while ready:
        # Kahn's algorithm; among ready writes prefer source locality, then plan order.
        pick = max(ready, key=lambda n: (len(reads.get(n[1], set()) & last), -n[1]))
        ready.remove(pick)
        order.append(pick)
        if pick[0] == "write":
            last = reads[pick[1]]
        for succ in graph.successors(pick):
            indegree[succ] -= 1
            if indegree[succ] == 0:
                ready.append(succ)
    assert len(order) == graph.number_of_nodes(), "the write/commit graph has a cycle"
    writes = tuple(plan.files[i] for kind, i in order if kind == "write")
    return plan.model_copy(update={"files": writes})
