"""Atomic commit of a checkpoint directory, and cleanup of what the commit retired.

Data files of every save carry a fresh token in their names, so a new save never
overwrites a file the live ``.metadata`` points to. On local disks the index,
``.metadata`` and the commit marker are written to temporary names, made durable, and
renamed into place, ``.metadata`` before the marker: that rename is the single atomic
step that switches readers from the old checkpoint to the new one. Object stores have
no atomic rename, so there the three are written directly, the marker last: there the
marker is the commit point (see ``dcp_ext.formats.marker``). Only after the commit are
data files no longer referenced removed (``cleanup``: their space is given back on a thread).

The new index lands before ``.metadata``, so the live index is first moved to a second
slot (``PREVIOUS_INDEX_NAME``): until the commit point the old ``.metadata`` keeps an
index that records it (readers consult that slot when the index does not record
``.metadata``), and a crash in between costs no checksums. The commit retires the slot
with the old data files; the next save puts a slot a dead commit left back, or drops it.

Before its commit point a save checks, with one listing, that every data file it
references is still there: a second job saving into the same directory removes the
first one's files as a dead save's, and publishing ``.metadata`` over them would lose
every checkpoint of the directory.

A save that fails removes what it wrote: its data files carry its token
(``__{rank}_{token}_{n}.distcp``) and no committed metadata ever references a token whose
save did not commit, so ``discard_save`` can delete them on any rank. Before a save writes,
``remove_dead_files`` deletes what dead saves (killed, or failed where nobody cleaned up)
left beside the live checkpoint: otherwise a disk that a failed save filled stays full
and every later save fails too.

The commit stops at ``crash_point``s (``dcp_ext.runtime.crash``) for the crash tests.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable

from dcp_ext.errors import CheckpointError
from dcp_ext.formats.data_files import is_data_file, save_token
from dcp_ext.formats.index import INDEX_NAME, PREVIOUS_INDEX_NAME
from dcp_ext.formats.marker import MARKER_NAME, CommitMarker
from dcp_ext.runtime.crash import crash_point
from dcp_ext.storage.catalog import METADATA_NAME, read_catalog
from dcp_ext.storage.location import Location
from dcp_ext.storage.writeback import PendingSyncs, syncs_later

TEMP_FILE = re.compile(r"^\.(metadata|dcp_ext_index\.parquet|dcp_ext_commit)\.[0-9a-f]+\.tmp$")



def commit(
    location: Location,
    save_id: str,
    metadata_bytes: bytes,
    index_bytes: bytes,
    referenced: set[str],
    sync: bool,
    at_commit_point: Callable[[], None] = lambda: None,
    data_durable: Callable[[], None] = lambda: None,
) -> None:
    """Publish a checkpoint whose data files (``referenced``) are already written (and synced,
    or syncing: ``data_durable`` waits until they are, and runs before anything names them;
    locally once the temporary files are written, so that their writes overlap the wait).

    ``at_commit_point`` runs once ``.metadata`` may reference the new data files: from
    then on a failure must not remove them (before it, ``discard_save`` removes them and
    the temporary files). Locally it runs just before the rename that publishes
    ``.metadata``: a Ctrl-C that lands in the rename is raised as it returns, and the
    failure handler then deleted the data files the new ``.metadata`` references (both
    checkpoints lost). A rename that fails instead leaves them unreferenced, for the
    next save's ``remove_dead_files``.
    """
    def marker(written_metadata: str) -> bytes:  # records the file's stamp: readers need not read it to trust the index
        return CommitMarker.for_bytes(save_id, metadata_bytes, index_bytes, location.stamp(written_metadata)).encode()

    if not location.is_local:
        data_durable()
        crash_point("before-commit")
        require_files(location, referenced)
        set_index_aside(location)
        location.write_bytes(INDEX_NAME, index_bytes, sync)
        crash_point("after-index")
        at_commit_point()  # an unmarked .metadata still loads with require_commit_marker=False
        location.write_bytes(METADATA_NAME, metadata_bytes, sync)
        crash_point("before-marker")
        location.write_bytes(MARKER_NAME, marker(METADATA_NAME), sync)  # the commit point
        return
    temps = {name: temp_name(name, save_id) for name in (INDEX_NAME, METADATA_NAME, MARKER_NAME)}
    # all three synced at once, beside the data files' syncs still running: one journal commit
    # takes them all (ext4's first fsync waited for the one with the data files anyway)
    together = sync and syncs_later(location)
    for name, data in ((INDEX_NAME, index_bytes), (METADATA_NAME, metadata_bytes)):
        location.write_bytes(temps[name], data, sync and not together)
    location.write_bytes(temps[MARKER_NAME], marker(temps[METADATA_NAME]), sync and not together)  # a rename keeps the stamp
    if together:
        PendingSyncs(location, list(temps.values())).wait()
    data_durable()
    if sync:
        location.sync_directory()  # data file and temp names are durable before the switch
    crash_point("before-commit")
    require_files(location, referenced)
    set_index_aside(location)
    _rename_into_place(location, temps[INDEX_NAME], INDEX_NAME)
    crash_point("after-index")
    at_commit_point()
    _rename_into_place(location, temps[METADATA_NAME], METADATA_NAME)  # the commit point
    crash_point("before-marker")
    _rename_into_place(location, temps[MARKER_NAME], MARKER_NAME)
    if sync:
        location.sync_directory()


def _rename_into_place(location: Location, temp: str, name: str) -> None:
    """Rename this save's ``temp`` into ``name``; a temp file that is gone was removed by
    another save's clean-up (``remove_dead_files`` takes any temp file for a dead save's)."""
    try:
        location.replace(temp, name)
    except FileNotFoundError:
        raise _two_jobs(location, f"its temporary file {temp} is gone while it commits: another save into this "
                                  "directory removed it") from None


def require_files(location: Location, referenced: set[str]) -> None:
    """Refuse to commit when a data file of this save is gone (one listing, on object
    stores too): another job saving into this directory took them for a dead save's."""
    missing = sorted(referenced - set(location.listdir()))
    if missing:
        raise _two_jobs(location, f"{len(missing)} data file(s) of this save were removed while it ran "
                                  f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): another save "
                                  "into this directory removed them")


def _two_jobs(location: Location, what: str) -> CheckpointError:
    return CheckpointError(
        f"{location.url}: {what}, so two jobs are saving here; this save is not committed (the directory keeps "
        "the checkpoint committed there)"
    )


def set_index_aside(location: Location) -> None:
    """Move the live index to its second slot: the live ``.metadata`` needs it until the
    commit point (``remove_dead_files`` made sure the index is the live one)."""
    with contextlib.suppress(FileNotFoundError):  # no index yet (a first save, a stock checkpoint)
        location.replace(INDEX_NAME, PREVIOUS_INDEX_NAME)


def temp_name(name: str, save_id: str) -> str:
    """Where a local commit writes ``name`` before renaming it into place."""
    return f"{name}.{save_id[:12]}.tmp"


def discard_save(location: Location, token: str, save_id: str = "", remove_dir: bool = False) -> list[str]:
    """Remove what an uncommitted save wrote: every rank's data files with its ``token`` and
    its temporary files; then the directory when the save created it and it is empty."""
    temps = {temp_name(name, save_id) for name in (INDEX_NAME, METADATA_NAME, MARKER_NAME)} if save_id else set()
    removed = [name for name in location.listdir() if save_token(name) == token or name in temps]
    for name in removed:
        location.remove(name)
    if remove_dir:
        location.remove_dir_if_empty()
    return removed


def remove_dead_files(location: Location) -> list[str]:
    """Before a save writes: remove temp files, and data files of ours that the committed
    checkpoint does not reference (dead saves' leftovers), so they cannot fill the disk;
    settle an index a dead commit set aside: back in place if ``.metadata`` still needs it
    (the commit died before its commit point), else dropped.

    Cheap in the usual case: data files of one save beside a ``.metadata``, and no index
    set aside, are taken to be the live checkpoint's; only other states read the committed
    metadata.
    """
    names = location.listdir()
    dead = [name for name in names if TEMP_FILE.match(name)]
    tokens = {save_token(name) for name in names} - {None}
    if len(tokens) > 1 or (tokens and METADATA_NAME not in names) or PREVIOUS_INDEX_NAME in names:
        live = live_checkpoint(location)
        if live is not None:
            files, index_name = live
            dead += [name for name in names if save_token(name) and name not in files]
            if index_name == PREVIOUS_INDEX_NAME:
                with contextlib.suppress(OSError):
                    location.replace(PREVIOUS_INDEX_NAME, INDEX_NAME)
            elif PREVIOUS_INDEX_NAME in names:
                dead.append(PREVIOUS_INDEX_NAME)
    for name in dead:
        with contextlib.suppress(OSError):  # opportunistic: never fails the save
            location.remove(name)
    return dead


def live_checkpoint(location: Location) -> tuple[set[str], str | None] | None:
    """The data files the committed checkpoint references and the file its index came
    from (``Catalog.index_name``); None when that cannot be told."""
    if not location.exists(METADATA_NAME):
        return set(), None
    try:
        catalog = read_catalog(location)
    except (CheckpointError, OSError):
        return None
    return catalog.files(), catalog.index_name


def unreferenced(location: Location, referenced: set[str]) -> list[str]:
    """The data and temp files the committed metadata does not reference, and the index
    set aside for the ``.metadata`` the commit replaced: what a commit retires, listed
    once, right after it (``cleanup.retire`` takes them out)."""
    return [
        name for name in location.listdir()
        if (is_data_file(name) and name not in referenced) or TEMP_FILE.match(name) or name == PREVIOUS_INDEX_NAME
    ]
