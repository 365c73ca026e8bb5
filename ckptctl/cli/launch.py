"""The ``ckptctl`` program's entry: the interrupt handler goes in before the CLI's modules are
imported, so that an interrupt at any moment, during the imports too, ends in one line and exit
code 130 rather than a traceback."""

from __future__ import annotations

import os
import signal
import sys

from ckptctl.cli.interrupts import INTERRUPTED, on_interrupt


def main() -> None:
    """The program: interrupted at any moment, it says so in one line and exits 130."""
    signal.signal(signal.SIGINT, on_interrupt)
    try:
        from ckptctl.cli.main import main as run

        run()
    except KeyboardInterrupt:  # before (or after) a command's own boundary
        _interrupted()
    except Exception:
        # pydantic builds its models' validators at import and wraps what interrupts it
        # (SchemaError): an interrupt noted is the interrupt whatever it became on the way out
        if not INTERRUPTED.is_set():
            raise
        _interrupted()


def _interrupted() -> None:
    sys.stderr.write("error: interrupted\n")
    sys.stderr.flush()
    os._exit(130)
