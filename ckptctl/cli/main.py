"""The CLI: the one composition root wiring probe -> planners -> executor -> report.

Exit codes: 0 success; 1 verification failed or unexpected error; 2 usage (bad flag, impossible
layout, existing output); 3 bad or missing checkpoint input; 4 storage error (missing bucket,
access denied, unreachable endpoint); 130 interrupted.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Annotated, Any, NoReturn

import typer
import typer.core

from ckptctl import __version__
from ckptctl.cli import (
    calibrate,
    compress,
    consolidate,
    demo,
    formats,
    inspect,
    merge_lora,
    plan,
    reshard,
    verify,
)
from ckptctl.cli.global_options import (
    AllowIncomplete,
    AllowRounding,
    CliState,
    Debug,
    EndpointUrl,
    HfConfig,
    PartSize,
    StorageOption,
    Tag,
    TextOnly,
    TrustField,
    UploadParallel,
    global_request,
    with_global_options,
)
from ckptctl.cli.output import Output


class CkptctlGroup(typer.core.TyperGroup):
    """The root command: a usage error (a bad flag or value, caught before any command runs)
    is one ``error:`` line naming the command's help, and under ``--json`` one JSON error
    document too, as every other error is."""

    def main(  # type: ignore[override]
        self,
        args: list[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> object:
        argv = list(sys.argv[1:] if args is None else args)
        options = argv[: argv.index("--")] if "--" in argv else argv
        if not standalone_mode or not argv:  # embedded, or the bare program: its help
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except Exception as err:  # Typer's own Click: its errors known by what they offer
            if type(err).__name__ == "Abort":  # ^C at a prompt
                raise KeyboardInterrupt from None
            exit_code = getattr(err, "exit_code", None)
            describe = getattr(err, "format_message", None)
            if exit_code is None or describe is None:
                raise
            command = next((a for a in argv if a in self.commands), "")
            Output("--json" in options).fail(
                describe().rstrip("."),
                exit_code,
                f"see ckptctl {command} --help".replace("  ", " "),
            )
            sys.exit(exit_code)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="ckptctl",
    cls=CkptctlGroup,
    help="Consolidate, reshard and verify sharded LLM training checkpoints. The options below "
    "may also follow the command (ckptctl inspect CKPT --debug).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    # Plain help (click's): every flag whole at any width, no type column beside flags.
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        print(f"ckptctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    debug: Debug = False,
    allow_incomplete: AllowIncomplete = False,
    endpoint_url: EndpointUrl = None,
    storage_option: StorageOption = None,
    part_size: PartSize = None,
    upload_parallel: UploadParallel = None,
    hf_config: HfConfig = None,
    trust_field: TrustField = None,
    tag: Tag = None,
    text_only: TextOnly = False,
    allow_rounding: AllowRounding = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Every command also takes these options after its name."""
    ctx.obj = CliState(
        global_request(
            debug,
            allow_incomplete,
            endpoint_url,
            storage_option,
            part_size,
            upload_parallel,
            hf_config,
            trust_field,
            tag,
            text_only,
            allow_rounding,
        )
    )


for name, command in (
    ("inspect", inspect.inspect_cmd),
    ("consolidate", consolidate.consolidate_cmd),
    ("merge-lora", merge_lora.merge_lora_cmd),
    ("reshard", reshard.reshard_cmd),
    ("plan", plan.plan_cmd),
    ("calibrate", calibrate.calibrate_cmd),
    ("verify", verify.verify_cmd),
    ("demo", demo.demo_cmd),
    ("formats", formats.formats_cmd),
    ("compress", compress.compress_cmd),
    ("decompress", compress.decompress_cmd),
):
    app.command(name)(with_global_options(command))


def run_command() -> None:
    """Run the command ``sys.argv`` names; leaves by ``SystemExit`` with its exit code, like
    any click program (what a caller embedding the CLI in its own process wants)."""
    try:
        app()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)


def interrupted() -> NoReturn:
    """Leave at once with exit code 130 after an interrupt the job has already unwound: the
    interpreter's teardown could only add noise (buffers still exported by an interrupted
    read report themselves as ignored exceptions)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(130)


def main() -> None:
    """The ``ckptctl`` program, leaving the ordinary way with the command's exit code (an
    interrupt, already unwound, leaves at once: see ``interrupted``).

    numpy's OpenBLAS is kept to the calling thread: ckptctl does no linear algebra, and
    OpenBLAS otherwise starts a thread per core when numpy is imported, which spins for ~0.1 s
    of CPU that a two-core machine's job needs (a user's own setting is kept)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        run_command()
    except SystemExit as done:
        if done.code == 130:
            interrupted()
        raise
