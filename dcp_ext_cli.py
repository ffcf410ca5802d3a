"""The ``dcp-ext`` console script's entry point.

It lives outside the ``dcp_ext`` package so that it runs before the package's imports
(torch among them: seconds): Ctrl-C while they load ends the command as it does later,
with one line and the shell's status for it, not an import traceback. The command itself
is ``dcp_ext.cli.main``.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a process ended by Ctrl-C


def _interrupted(signum: int, frame: FrameType | None) -> None:
    print("error: interrupted", file=sys.stderr, flush=True)
    os._exit(INTERRUPTED)  # nothing has been written yet: no teardown to wait for


def run() -> None:
    previous = signal.signal(signal.SIGINT, _interrupted)
    from dcp_ext.cli.main import run as run_command

    signal.signal(signal.SIGINT, previous)
    run_command()


if __name__ == "__main__":
    run()
