"""``ckptctl formats``: what ckptctl reads and writes, and what each format supports."""

from __future__ import annotations

import typer

from ckptctl.cli.options import Json, state
from ckptctl.cli.output import Output, boundary
from ckptctl.formats import registry
from ckptctl.formats.support import STORES


def formats_cmd(ctx: typer.Context, as_json: Json = False) -> None:
    """List the checkpoint formats ckptctl reads and writes, how each is recognised, what
    it supports and what verify can prove about it."""
    out = Output(as_json)
    described = [f.support for f in registry.formats() if f.support is not None]
    with boundary(out, state(ctx).debug):
        if as_json:
            out.json({"formats": [f.as_dict() for f in described], "stores": STORES})
            return
        for f in described:
            out.show(f"[bold]{f.name}[/]  {f.description}")
            out.show(f"  reads: {'yes' if f.reads else 'no'}; written by: {f.writes or '-'}")
            out.show(f"  recognised by: {f.recognised_by}")
            out.show(f"  supports: {f.supports}")
            out.show(f"  verify without a manifest: {f.checksums}")
        out.show(f"stores: {STORES}")
