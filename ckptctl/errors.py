"""The error vocabulary: one root, subclasses that also derive from the builtin they resemble.

The CLI maps every ``CkptctlError`` to a one-line message and an exit code; anything else is a
bug and gets a traceback.
"""

from __future__ import annotations


class CkptctlError(Exception):
    """Root of every error ckptctl raises on purpose."""

    exit_code: int = 1


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


class StorageError(CkptctlError):
    """The store refused or failed an operation (missing bucket, access denied, network)."""

    exit_code = 4
