"""``ckptctl calibrate``: measure a storage target's bandwidth and latency for later plans."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptctl.cli.options import Json, parse_size, state
from ckptctl.cli.output import Output, boundary
from ckptctl.cli.units import human_bytes
from ckptctl.io.calibrate import calibrate, save_profile


def calibrate_cmd(
    ctx: typer.Context,
    url: Annotated[
        str, typer.Argument(help="Directory or URL to measure (writes a scratch file).")
    ],
    size: Annotated[str, typer.Option("--size", help="Scratch file size.")] = "64MiB",
    save: Annotated[
        Path | None,
        typer.Option("--out", help="Where to save the profile (default: the config directory)."),
    ] = None,
    as_json: Json = False,
) -> None:
    """Measure bandwidth and latency of a storage target; later plans on that URL use it."""
    out = Output(as_json)
    cli = state(ctx)
    with boundary(out, cli.debug):
        profile = calibrate(url, parse_size(size), config=cli.settings.storage)
        path = save_profile(profile, save)
        if as_json:
            out.json({**profile.model_dump(mode="json"), "saved_to": str(path)})
        else:
            out.show(
                f"{url}: read {human_bytes(profile.read_bandwidth)}/s, write "
                f"{human_bytes(profile.write_bandwidth)}/s, latency "
                f"{profile.latency * 1e3:.2f} ms; saved to {path}"
            )
