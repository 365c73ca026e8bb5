"""Simulated nodes on one machine: each a torchrun process (``--nnodes N --node-rank i``, one
process per node, static rendezvous on 127.0.0.1) reaching S3 through its own endpoint (an
``S3Proxy`` in front of the store, optionally rate-capped as the node's link). Used by the
scale-out tests and ``bench/bench_nodes.py``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_node(
    rank: int, nodes: int, port: int, endpoint: str, argv: list[str]
) -> subprocess.Popen:
    """Node ``rank`` of ``nodes`` running ``ckptctl *argv --json``, reaching S3 at
    ``endpoint``; the rendezvous on ``port`` of 127.0.0.1."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
         "--node-rank", str(rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "ckptctl", *argv, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AWS_ENDPOINT_URL": endpoint},
    )  # fmt: skip
