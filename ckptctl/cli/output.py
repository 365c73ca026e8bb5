"""One output object and one error boundary: data to stdout (a human table or exactly one JSON
document), logs, warnings, hints and progress to stderr; every exception that reaches a command
becomes one line (and under ``--json`` one error document) and an exit code. Only the CLI knows
rich, and imports it only to print something for people: a ``--json`` run never loads it
(~30 ms of start-up, more from a cold disk)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import typer
from pydantic import ValidationError

from ckptctl.cli.interrupts import INTERRUPTED
from ckptctl.errors import CkptctlError
from ckptctl.io.storage_errors import classify

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


class Output:
    def __init__(self, as_json: bool = False, quiet: bool = False) -> None:
        self.as_json = as_json
        self.quiet = quiet
        self.silent = False
        """One rank of several other than rank 0: errors only (rank 0 speaks for the job)."""
        self._consoles: dict[str, Console] = {}

    @property
    def out(self) -> Console:
        """Standard output, for tables and lines meant for people."""
        return self._console("out")

    @property
    def err(self) -> Console:
        """Standard error: logs, warnings, errors, progress."""
        return self._console("err")

    def _console(self, name: str) -> Console:
        if name not in self._consoles:
            from rich.console import Console

            stream = sys.stdout if name == "out" else sys.stderr
            self._consoles[name] = Console(file=stream, soft_wrap=True)
        return self._consoles[name]

    def _line(self, label: str, colour: str, message: str) -> None:
        """One line on stderr, ``label: message``: coloured by rich on a terminal (or while a
        progress bar holds it), written as it is otherwise. The message is never markup."""
        if "err" in self._consoles or sys.stderr.isatty():
            from rich.markup import escape

            prefix = f"[{colour}]{label}:[/] " if label else ""
            self.err.print(prefix + escape(message), highlight=False, emoji=False)
        else:
            sys.stderr.write(f"{label}: {message}\n" if label else f"{message}\n")
            sys.stderr.flush()

    @staticmethod
    def table(*columns: str, **options: Any) -> Table:
        """A rich table with these column headers (for ``show``)."""
        from rich.table import Table

        return Table(*columns, **options)

    def info(self, message: str) -> None:
        if not self.quiet and not self.as_json and not self.silent:
            self._line("", "", message)

    def note(self, message: str) -> None:
        """Something the user may want to know (what a format holds, a choice made)."""
        if not self.quiet and not self.as_json and not self.silent:
            self._line("note", "cyan", message)

    def warn(self, message: str) -> None:
        """Something that may be wrong for the user's purpose (state dropped, not carried)."""
        if not self.silent:
            self._line("warning", "yellow", message)

    def fail(self, message: str, exit_code: int, hint: str = "") -> None:
        """A failed command: one line on stderr, and under --json one error document on stdout
        (``error``, ``exit_code``, ``hint``) so that scripts never parse stderr."""
        self._line("error", "red", message + (f"; {hint}" if hint else ""))
        if self.as_json:
            self.json({"error": message, "exit_code": exit_code, "hint": hint})

    def json(self, data: Any) -> None:
        if self.silent and "error" not in data:
            return
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        sys.stdout.flush()

    def json_parts(self, parts: Iterable[str]) -> None:
        """A JSON document too large to build whole (a plan), written as it is made."""
        if self.silent:
            return
        sys.stdout.writelines(parts)
        sys.stdout.flush()

    def progress(self) -> Any:
        """A progress sink for a long command: rich's bar on stderr for people, nothing
        under ``--json`` or ``--quiet`` (``ckptctl.pipeline.job_report.Progress``)."""
        if self.as_json or self.quiet or self.silent:
            from ckptctl.progress import NoProgress

            return NoProgress()
        from ckptctl.cli.progress_bar import RichProgress

        return RichProgress(self.err)

    def show(self, renderable: Any) -> None:
        if not self.silent:
            self.out.print(renderable)


@contextlib.contextmanager
def boundary(out: Output, debug: bool = False) -> Iterator[None]:
    """Known errors become one line on stderr (and, under --json, one JSON error document on
    stdout) and an exit code; tracebacks only with --debug."""
    try:
        yield
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        out.fail(
            "interrupted; nothing was marked complete", 130, "rerun the same command to resume"
        )
        raise typer.Exit(130) from None
    except Exception as err:
        if INTERRUPTED.is_set():  # the interrupt's own unwinding failed on the way out
            out.fail(
                "interrupted; nothing was marked complete", 130, "rerun the same command to resume"
            )
            raise typer.Exit(130) from None
        if debug:
            raise
        message, code, hint = explain(err)
        if not (out.silent and getattr(err, "from_another_rank", False)):
            out.fail(message, code, hint)  # (the failing rank says it once)
        raise typer.Exit(code) from None


def explain(err: Exception) -> tuple[str, int, str]:
    """(message, exit code, hint) for any exception that reaches the CLI."""
    if isinstance(err, CkptctlError):
        return err.message, err.exit_code, err.hint
    if isinstance(err, ValidationError):
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
        return problems, 2, ""
    if isinstance(err, FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return f"{err.filename or ''}: {err.strerror or err}", 3, "check the checkpoint path"
    storage = classify(err)
    if storage is not None:
        return storage.message, storage.exit_code, storage.hint
    # A bug, not bad input: say so in one line, trace on request.
    return (
        f"internal error {type(err).__name__}: {err}; nothing was marked complete",
        1,
        "rerun with --debug for the traceback and report it",
    )
