"""``ckptctl formats``: what ckptctl reads and writes, and what each format supports."""

from __future__ import annotations

import typer

from ckptctl.cli.options import Json, state
from ckptctl.cli.output import Output, boundary
from ckptctl.formats import registry
from ckptctl.formats.support import STORES
from ckptctl.model.hf_families import FAMILIES, family_summary


def formats_cmd(ctx: typer.Context, as_json: Json = False) -> None:
    """List the checkpoint formats ckptctl reads and writes, how each is recognised, what
    it supports and what verify can prove about it."""
    out = Output(as_json)
    described = [f.support for f in registry.formats() if f.support is not None]
    with boundary(out, state(ctx).debug):
        families = [family_summary(f) for f in FAMILIES.values()]
        if as_json:
            out.json(
                {
                    "formats": [f.as_dict() for f in described],
                    "model_families": families,
                    "stores": STORES,
                }
            )
            return
        for f in described:
            out.show(f"[bold]{f.name}[/]  {f.description}")
            out.show(f"  reads: {'yes' if f.reads else 'no'}; written by: {f.writes or '-'}")
            out.show(f"  recognised by: {f.recognised_by}")
            out.show(f"  supports: {f.supports}")
            out.show(f"  verify without a manifest: {f.checksums}")
        out.show("model families (HF classes, read and written; Megatron holds them all):")
        for family in families:
            out.show(f"  {family['architecture']} ({family['model_type']}): {family['holds']}")
        out.show(
            "  Megatron-only (refused for HF, with the reason): non-gated MLPs, partial RoPE, "
            "LayerNorm, learned positions"
        )
        out.show(f"stores: {STORES}")
