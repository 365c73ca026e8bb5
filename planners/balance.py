"""Spread reads over several stored copies of the same shards (node-local NVMe and the data lake,
two replicas) in proportion to what each can deliver: a min-cost flow over files and copies.
Pure; networkx stays inside this module."""

from __future__ import annotations

from dataclasses import replace as dc_replace

from ckptctl.model.geometry import nbytes
from ckptctl.model.plan import Plan
from ckptctl.model.profile import StorageProfile

_UNIT = 1 << 16  # flow works in 64 KiB units to keep the graph's numbers small


def balance_reads(
    plan: Plan, copies_of: dict[str, StorageProfile], primary: StorageProfile
) -> Plan:
    """Reassign reads of each primary source file to the copies (``{prefix: profile}``) that
    also hold it, so every location's share of bytes matches its share of read bandwidth."""
    locations = {"": primary, **copies_of}
    per_file: dict[str, int] = {}
    for file in plan.files:
        for tensor in file.tensors:
            for copy in tensor.copies:
                path = plan.source_files[copy.source]
                per_file[path] = per_file.get(path, 0) + nbytes(copy.sizes, tensor.dtype)
    if not per_file:
        return plan
    total_bw = sum(p.read_bandwidth for p in locations.values())
    total = sum(-(-b // _UNIT) for b in per_file.values())
    import networkx as nx  # 0.1 s to import: only when a plan is made

    graph = nx.DiGraph()
    graph.add_node("sink", demand=total)
    for prefix, profile in locations.items():
        share = -(-total * profile.read_bandwidth // total_bw) + 1
        # Cheaper per unit where bandwidth is higher: ties go to the faster store.
        graph.add_edge(
            ("loc", prefix), "sink", capacity=int(share), weight=int(1e9 / profile.read_bandwidth)
        )
    for path, size in sorted(per_file.items()):
        units = -(-size // _UNIT)
        graph.add_node(("file", path), demand=-units)
        for prefix in locations:
            graph.add_edge(("file", path), ("loc", prefix), capacity=units, weight=0)
    flow = nx.min_cost_flow(graph)
    quota = {
        path: {prefix: flow[("file", path)][("loc", prefix)] * _UNIT for prefix in locations}
        for path in per_file
    }
    index = {path: i for i, path in enumerate(plan.source_files)}
    sources = list(plan.source_files)

    def source_index(path: str) -> int:
        if path not in index:
            index[path] = len(sources)
            sources.append(path)
        return index[path]

    files = []
    for file in plan.files:
        tensors = []
        for tensor in file.tensors:
            moved = []
            for copy in tensor.copies:
                path = plan.source_files[copy.source]
                left = quota[path]
                prefix = next(
                    (p for p in sorted(left, key=lambda p: (p != "", p)) if left[p] > 0), ""
                )
                left[prefix] -= nbytes(copy.sizes, tensor.dtype)
                moved.append(dc_replace(copy, source=source_index(prefix + path)))
            tensors.append(dc_replace(tensor, copies=tuple(moved)))
        files.append(file.model_copy(update={"tensors": tuple(tensors)}))
    return plan.model_copy(update={"files": tuple(files), "source_files": tuple(sources)})
