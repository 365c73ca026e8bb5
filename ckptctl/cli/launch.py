"""The ``ckptctl`` program's entry: before the CLI is imported (~0.2 s, most of a conversion's
start-up), a conversion's local source starts streaming into the page cache
(``ckptctl.read_early``), so the disk works while the interpreter imports."""

from __future__ import annotations

import os
import sys

CONVERSIONS = frozenset({"consolidate", "reshard"})
"""Commands that read (nearly) all of their source."""

HELP = frozenset({"--help", "-h"})

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
"""Set by torchrun: each rank reads only its share of a source, planned."""


def early_source(args: list[str]) -> str | None:
    """The local source a conversion's arguments name, or ``None``: the first argument after
    ``consolidate`` / ``reshard``, when it is an existing local path (the CLI itself still
    parses every argument; a guess that misses only forgoes the head start)."""
    words = [a for a in args if not a.startswith("-")]
    if not words or words[0] not in CONVERSIONS or HELP & set(args):
        return None
    at = args.index(words[0]) + 1
    if at >= len(args) or args[at].startswith("-"):
        return None
    source = args[at].removeprefix("file://")
    if "://" in source or not os.path.exists(source):
        return None
    return source


def main() -> None:
    source = early_source(sys.argv[1:])
    if source is not None and not any(os.environ.get(v) for v in RANK_VARIABLES):
        from ckptctl import read_early

        read_early.start(source)
    from ckptctl.cli.main import main as run

    run()
