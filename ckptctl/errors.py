"""The error vocabulary: one root, subclasses that also derive from the builtin they resemble.

The CLI maps every ``CkptctlError`` to a one-line message and an exit code; anything else is a
bug and gets a traceback.
"""

from __future__ import annotations


class CkptctlError(Exception):
    """Root of every error ckptctl raises on purpose.

    ``hint`` says what to do next; the CLI prints it after the message (and as its own field of
    the ``--json`` error document)."""

    exit_code: int = 1
    hint: str = ""

    def __init__(self, *args: object, hint: str = "") -> None:
        super().__init__(*args)
        if hint:
            self.hint = hint

    def __str__(self) -> str:
        message = super().__str__()
        return f"{message}; {self.hint}" if self.hint else message

    @property
    def message(self) -> str:
        """The message without the hint."""
        return super().__str__()


class LayoutError(CkptctlError, ValueError):
    """A model spec or parallel layout that cannot exist (e.g. tp does not divide the heads)."""

    exit_code = 2

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class UsageError(CkptctlError, ValueError):
    """A flag or argument combination that cannot be honoured."""

    exit_code = 2


class CheckpointError(CkptctlError, ValueError):
    """A checkpoint whose contents are missing, malformed or inconsistent."""

    exit_code = 3


class CheckpointNotFoundError(CkptctlError, FileNotFoundError):
    """A file or directory the checkpoint needs is absent."""

    exit_code = 3


class UnsafePickleError(CheckpointError):
    """A pickle asked for a global outside the allow-list; nothing was executed."""


class OutputExistsError(CkptctlError, FileExistsError):
    """The destination already holds a checkpoint and --overwrite was not given."""

    exit_code = 2


class StorageError(CkptctlError, OSError):
    """The store refused or failed an operation (missing bucket, access denied, network, disk
    full, unknown URL scheme)."""

    exit_code = 4

    def __str__(self) -> str:  # OSError's own __str__ would show the args tuple
        return CkptctlError.__str__(self)
