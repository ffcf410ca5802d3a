"""``crash_point``: a test hook that kills the process at an exact phase of a save.

With ``DCP_EXT_CRASH_AT=<phase>`` in its environment a process SIGKILLs itself when a save
reaches that phase, so the crash tests can stop a save at exact points. Phases, in save
order: ``before-data`` (a rank starts writing), ``mid-file`` (a file holds its first
record), ``after-file`` (a rank closed its first file), ``after-data`` (all data written,
nothing committed), ``before-commit`` (temporary files written), ``after-index`` (index
published, ``.metadata`` not), ``before-marker`` (``.metadata`` published),
``mid-cleanup`` (first retired file removed). Unset, it costs one environment lookup
per phase.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "DCP_EXT_CRASH_AT"


def crash_point(phase: str) -> None:
    """SIGKILL this process when ``DCP_EXT_CRASH_AT`` names ``phase``."""
    if os.environ.get(CRASH_ENV) == phase:
        os.kill(os.getpid(), signal.SIGKILL)
