"""The CLI's interrupt: noted as it happens, so that a job unwinding from it is reported as
interrupted (exit 130) whatever fails on the way out. Imports nothing heavy: it is installed
before anything else is imported."""

from __future__ import annotations

import threading

INTERRUPTED = threading.Event()
"""Set when the user interrupts the process (``on_interrupt``): an error raised while the
interrupt unwinds the job (a file closed under a reader) is the interrupt, not a failure."""


def on_interrupt(signum: int, frame: object) -> None:
    """The CLI's SIGINT handler: note the interrupt, then raise ``KeyboardInterrupt`` as
    Python's own handler does, so that every ``finally`` of the job runs."""
    INTERRUPTED.set()
    raise KeyboardInterrupt
