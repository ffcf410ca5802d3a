"""Atomic commit of a checkpoint directory, and cleanup of what the commit retired.

Data files of every save carry a fresh token in their names, so a new save never
overwrites a file the live ``.metadata`` points to. The index and ``.metadata`` are
written to temporary names, made durable, and renamed into place, ``.metadata`` last:
that rename is the single atomic step that switches readers from the old checkpoint to
the new one. Only then are data files no longer referenced removed.
"""

from __future__ import annotations

import re

from dcp_ext.formats.index import INDEX_NAME
from dcp_ext.storage.catalog import METADATA_NAME
from dcp_ext.storage.location import Location

DATA_FILE = re.compile(r"^__\d+_[^/]*\.distcp$")
TEMP_FILE = re.compile(r"^\.(metadata|dcp_ext_index\.parquet)\.[0-9a-f]+\.tmp$")


def commit(location: Location, token: str, metadata_bytes: bytes, index_bytes: bytes, sync: bool) -> None:
    """Publish a checkpoint whose data files are already written (and synced)."""
    index_tmp = f"{INDEX_NAME}.{token}.tmp"
    metadata_tmp = f"{METADATA_NAME}.{token}.tmp"
    location.write_bytes(index_tmp, index_bytes, sync)
    location.write_bytes(metadata_tmp, metadata_bytes, sync)
    if sync:
        location.sync_directory()  # data file and temp names are durable before the switch
    location.replace(index_tmp, INDEX_NAME)
    location.replace(metadata_tmp, METADATA_NAME)  # the commit point
    if sync:
        location.sync_directory()


def remove_unreferenced(location: Location, referenced: set[str]) -> list[str]:
    """Delete data and temp files that the committed metadata does not reference."""
    removed = []
    for name in location.listdir():
        if (DATA_FILE.match(name) and name not in referenced) or TEMP_FILE.match(name):
            location.remove(name)
            removed.append(name)
    return removed
