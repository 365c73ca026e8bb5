"""The CLI: the one composition root wiring probe -> planners -> executor -> report.

Exit codes: 0 success; 1 verification failed or unexpected error; 2 usage (bad flag, impossible
layout, existing output); 3 bad or missing checkpoint input; 4 storage error (missing bucket,
access denied, unreachable endpoint); 130 interrupted.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Annotated

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
    plan,
    reshard,
    verify,
)
from ckptctl.cli.options import CliState, read_hf_config, storage_config
from ckptctl.cli.output import Output, boundary
from ckptctl.settings import Settings

GLOBAL_FLAGS = frozenset({"--debug", "--allow-incomplete"})
GLOBAL_VALUED = frozenset(
    {"--endpoint-url", "--storage-option", "--part-size", "--upload-parallel", "--hf-config"}
)


def hoist_global_options(args: list[str], commands: set[str]) -> list[str]:
    """Global options given after the command move before it, as the aws and hf CLIs accept
    them anywhere: ``ckptctl inspect s3://b/x --endpoint-url URL``."""
    at, i = None, 0
    while i < len(args) and at is None:
        if args[i] in GLOBAL_VALUED:
            i += 1  # skip the option's value
        elif args[i] in commands:
            at = i
        i += 1
    if at is None:
        return args
    moved: list[str] = []
    kept: list[str] = []
    rest = args[at + 1 :]
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            kept += rest[i:]
            break
        if arg in GLOBAL_FLAGS or ("=" in arg and arg.split("=", 1)[0] in GLOBAL_VALUED):
            moved.append(arg)
        elif arg in GLOBAL_VALUED and i + 1 < len(rest):
            moved += rest[i : i + 2]
            i += 1
        else:
            kept.append(arg)
        i += 1
    return [*args[:at], *moved, args[at], *kept]


class CkptctlGroup(typer.core.TyperGroup):
    """The root command: global options anywhere, and under ``--json`` a usage error (a bad
    flag or value, caught before any command runs) is one JSON error document too."""

    def main(  # type: ignore[override]
        self,
        args: list[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: object,
    ) -> object:
        argv = hoist_global_options(
            list(sys.argv[1:] if args is None else args), set(self.commands)
        )
        options = argv[: argv.index("--")] if "--" in argv else argv
        if not standalone_mode or "--json" not in options:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except Exception as err:
            exit_code, describe = (
                getattr(err, "exit_code", None),
                getattr(err, "format_message", None),
            )
            if exit_code is None or describe is None:
                raise
            command = next((a for a in argv if a in self.commands), "")
            Output(True).fail(
                describe(), exit_code, f"see ckptctl {command} --help".replace("  ", " ")
            )
            sys.exit(exit_code)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="ckptctl",
    cls=CkptctlGroup,
    help="Consolidate, reshard and verify sharded LLM training checkpoints. Global options "
    "(--endpoint-url, --storage-option, --debug, ...) may also follow the command.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        print(f"ckptctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    allow_incomplete: Annotated[
        bool,
        typer.Option("--allow-incomplete", help="Read checkpoints a ckptctl job never finished."),
    ] = False,
    endpoint_url: Annotated[
        str | None,
        typer.Option(
            "--endpoint-url",
            help="S3-compatible endpoint (MinIO, Ceph RGW); default: AWS config, AWS_ENDPOINT_URL.",
        ),
    ] = None,
    storage_option: Annotated[
        list[str] | None,
        typer.Option(
            "--storage-option",
            help="fsspec option for remote URLs as key=value (repeatable), e.g. anon=true.",
        ),
    ] = None,
    part_size: Annotated[
        str, typer.Option("--part-size", help="Multipart upload part size (>= 5MiB).")
    ] = "8MiB",
    upload_parallel: Annotated[
        int, typer.Option("--upload-parallel", help="Parts of one object uploaded at once.")
    ] = 8,
    hf_config: Annotated[
        str | None,
        typer.Option(
            "--hf-config",
            help="config.json (or its directory) of the HF model a DCP checkpoint holds "
            "(FSDP2 / DTensor training of an HF Llama); looked for beside the checkpoint too.",
        ),
    ] = None,
    trust_field: Annotated[
        list[str] | None,
        typer.Option(
            "--trust-field",
            help="A field of the model description (Megatron args, config.json) that ckptctl "
            "does not know, vouched for as not changing the tensors' layout or meaning "
            "(repeatable). Unknown fields are refused otherwise.",
        ),
    ] = None,
    tag: Annotated[
        str | None,
        typer.Option(
            "--tag",
            help="DeepSpeed checkpoint tag directory to read instead of the one 'latest' names.",
        ),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    out = Output(False)
    with boundary(out, debug):
        storage = storage_config(endpoint_url, storage_option or [], part_size, upload_parallel)
        settings = Settings(
            storage=storage,
            allow_incomplete=allow_incomplete,
            hf_config=read_hf_config(hf_config, storage) if hf_config else None,
            trusted_fields=frozenset(name.removeprefix("args.") for name in trust_field or ()),
            tag=tag,
        )
        ctx.obj = CliState(settings, debug)


for name, command in (
    ("inspect", inspect.inspect_cmd),
    ("consolidate", consolidate.consolidate_cmd),
    ("reshard", reshard.reshard_cmd),
    ("plan", plan.plan_cmd),
    ("calibrate", calibrate.calibrate_cmd),
    ("verify", verify.verify_cmd),
    ("demo", demo.demo_cmd),
    ("formats", formats.formats_cmd),
    ("compress", compress.compress_cmd),
    ("decompress", compress.decompress_cmd),
):
    app.command(name)(command)


def run_command() -> None:
    """Run the command ``sys.argv`` names; leaves by ``SystemExit`` with its exit code, like
    any click program (what a caller embedding the CLI in its own process wants)."""
    try:
        app()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)


def main(on_success: Callable[[], None] | None = None) -> None:
    """The ``ckptctl`` program (``on_success``: called once a command has succeeded). After a
    command succeeds, the process leaves at once instead of tearing the interpreter down:
    module teardown (numpy, pydantic, the layout models) takes ~45 ms, 4% of a one-second
    conversion, and nothing is left for it to do: every output is closed and flushed, worker
    threads are idle, a process group is closed. A failure takes the ordinary way out, where
    nothing is skipped, and so does a run under a profiler or a coverage tracer (they write
    their results at exit).

    numpy's OpenBLAS is kept to the calling thread: ckptctl does no linear algebra, and
    OpenBLAS otherwise starts a thread per core when numpy is imported, which spins for ~0.1 s
    of CPU that a two-core machine's job needs (a user's own setting is kept)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        run_command()
    except SystemExit as done:
        if done.code not in (0, None) or sys.getprofile() or sys.gettrace():
            raise
    if on_success is not None:
        on_success()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe: let the interpreter report it as usual
        return
    os._exit(0)
