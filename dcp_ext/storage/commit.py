"""Atomic commit of a checkpoint directory, and cleanup of what the commit retired.

Data files of every save carry a fresh token in their names, so a new save never
overwrites a file the live ``.metadata`` points to. On local disks the index,
``.metadata`` and the commit marker are written to temporary names, made durable, and
renamed into place, ``.metadata`` before the marker: that rename is the single atomic
step that switches readers from the old checkpoint to the new one. Object stores have
no atomic rename, so there the three are written directly, the marker last: there the
marker is the commit point (see ``dcp_ext.formats.marker``). Only after the commit are
data files no longer referenced removed.

``crash_point`` is a test hook: with ``DCP_EXT_CRASH_AT=<phase>`` in its environment a
process SIGKILLs itself when a save reaches that phase, so the crash tests can stop a
save at exact points. Phases, in save order: ``before-data`` (a rank starts writing),
``mid-file`` (a file holds its first record), ``after-file`` (a rank closed its first
file), ``after-data`` (all data written, nothing committed), ``before-commit`` (temporary
files written), ``after-index`` (index published, ``.metadata`` not), ``before-marker``
(``.metadata`` published), ``mid-cleanup`` (first retired file removed). Unset, it costs
one environment lookup per phase.
"""

from __future__ import annotations

import os
import re
import signal

from dcp_ext.formats.index import INDEX_NAME
from dcp_ext.formats.marker import MARKER_NAME, CommitMarker
from dcp_ext.storage.catalog import METADATA_NAME
from dcp_ext.storage.location import Location

CRASH_ENV = "DCP_EXT_CRASH_AT"
DATA_FILE = re.compile(r"^__\d+_[^/]*\.distcp$")
TEMP_FILE = re.compile(r"^\.(metadata|dcp_ext_index\.parquet|dcp_ext_commit)\.[0-9a-f]+\.tmp$")


def crash_point(phase: str) -> None:
    """Test hook: SIGKILL this process when ``DCP_EXT_CRASH_AT`` names ``phase``."""
    if os.environ.get(CRASH_ENV) == phase:
        os.kill(os.getpid(), signal.SIGKILL)


def commit(location: Location, save_id: str, metadata_bytes: bytes, index_bytes: bytes, sync: bool) -> None:
    """Publish a checkpoint whose data files are already written (and synced)."""
    marker = CommitMarker.for_bytes(save_id, metadata_bytes, index_bytes).encode()
    if not location.is_local:
        crash_point("before-commit")
        location.write_bytes(INDEX_NAME, index_bytes, sync)
        crash_point("after-index")
        location.write_bytes(METADATA_NAME, metadata_bytes, sync)
        crash_point("before-marker")
        location.write_bytes(MARKER_NAME, marker, sync)  # the commit point
        return
    temps = {name: f"{name}.{save_id[:12]}.tmp" for name in (INDEX_NAME, METADATA_NAME, MARKER_NAME)}
    for name, data in ((INDEX_NAME, index_bytes), (METADATA_NAME, metadata_bytes), (MARKER_NAME, marker)):
        location.write_bytes(temps[name], data, sync)
    if sync:
        location.sync_directory()  # data file and temp names are durable before the switch
    crash_point("before-commit")
    location.replace(temps[INDEX_NAME], INDEX_NAME)
    crash_point("after-index")
    location.replace(temps[METADATA_NAME], METADATA_NAME)  # the commit point
    crash_point("before-marker")
    location.replace(temps[MARKER_NAME], MARKER_NAME)
    if sync:
        location.sync_directory()


def remove_unreferenced(location: Location, referenced: set[str]) -> list[str]:
    """Delete data and temp files that the committed metadata does not reference."""
    removed = []
    for name in location.listdir():
        if (DATA_FILE.match(name) and name not in referenced) or TEMP_FILE.match(name):
            location.remove(name)
            removed.append(name)
            crash_point("mid-cleanup")
    return removed
