"""Simulated nodes on one machine: each a torchrun process (``--nnodes N --node-rank i``, one
process per node, static rendezvous on 127.0.0.1) reaching S3 through its own endpoint (an
``S3Proxy`` in front of the store, optionally rate-capped as the node's link), or its own disk.
Used by the scale-out tests, ``bench/bench_nodes.py`` and ``bench/bench_disks.py``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_node(
    rank: int,
    nodes: int,
    port: int,
    endpoint: str | None,
    argv: list[str],
    wrapper: Sequence[str] = (),
) -> subprocess.Popen:
    """Node ``rank`` of ``nodes`` running ``ckptctl *argv --json``, reaching S3 at
    ``endpoint`` (if given); the rendezvous on ``port`` of 127.0.0.1. ``wrapper``: a command
    the node runs under (its own mount namespace, say)."""
    env = {**os.environ, **({"AWS_ENDPOINT_URL": endpoint} if endpoint else {})}
    return subprocess.Popen(
        [*wrapper, sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
         "--node-rank", str(rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "ckptctl", *argv, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
