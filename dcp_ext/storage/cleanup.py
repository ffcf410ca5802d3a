"""The files a commit retired, taken out of the directory without waiting for their space.

Once a save into a directory that held a checkpoint has committed, its coordinator
deletes the files only the replaced checkpoint referenced. Unlinking a large file gives
its blocks back within the call: 18-24 ms for a 135 MB file on the project's machine
(ext4 mounted with ``discard``: the freed blocks are trimmed), so a 2-process save of
0.54 GB into its own directory again spent 65-73 ms of its ~270 on the coordinator's
critical path; more ranks mean more files, all deleted by the coordinator. A file
unlinked while a process holds it open leaves the directory at once (0.07 ms for four)
and gives its blocks back when the last descriptor is closed. So each retired file is
opened, unlinked (the directory holds the committed files only when ``dcp.save``
returns, as before) and closed by a thread. The next save into the directory from this
process waits for that thread before it lists the directory (it may need the space), as
does ``ShardWriter.close()``; at exit the kernel closes what is left.

Only where the file system frees an open unlinked file's blocks at its last close and
shows nothing meanwhile (``DEFERS_FREEING``): NFS renames it to ``.nfsXXXX`` until then,
FUSE file systems to ``.fuse_hidden*``. Elsewhere each file is removed in turn, as
before; on a remote store as many at once as it deletes in one request
(``Location.remove_all``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

from dcp_ext.runtime.crash import crash_point
from dcp_ext.storage.location import Location

DEFERS_FREEING = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs"})

_PENDING: dict[str, threading.Thread] = {}  # location.cache_key() -> the thread closing its retired files
_HELD: set[int] = set()  # descriptors of retired files not closed yet
_LOCK = threading.Lock()  # held across a fork: a child sees _HELD as it is


def retire(location: Location, names: list[str]) -> None:
    """Take ``names`` out of ``location``; where the file system allows, their space comes
    back once a thread has closed them. A file already gone is skipped; any other failure
    raises (with the files taken out so far closed by the thread)."""
    if not names:
        return
    if not (location.is_local and file_system_type(location.root) in DEFERS_FREEING):
        location.remove_all(names)  # in turn; an object store takes many in one request
        crash_point("mid-cleanup")
        return
    held: list[int] = []
    try:
        for name in names:
            path = location.path(name)
            try:
                with _LOCK:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    _HELD.add(fd)
            except FileNotFoundError:
                continue
            except PermissionError:  # unlinking needs no read access to the file: removed in turn
                location.remove(name)
            else:
                held.append(fd)
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile (another save's clean-up)
                    os.unlink(path)
            crash_point("mid-cleanup")
    finally:
        _close_later(location, held)


def wait_for_cleanup(location: Location) -> None:
    """Return once the files ``location``'s last commit retired are closed."""
    key = location.cache_key()
    with _LOCK:
        thread = _PENDING.get(key)
    if thread is None:
        return
    thread.join()
    with _LOCK:
        if _PENDING.get(key) is thread:
            del _PENDING[key]


def _close_later(location: Location, fds: list[int]) -> None:
    if not fds:
        return
    wait_for_cleanup(location)
    thread = threading.Thread(target=_close_all, args=(fds,), name="dcp_ext-cleanup", daemon=True)
    with _LOCK:
        _PENDING[location.cache_key()] = thread
    thread.start()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with _LOCK:
            if fd in _HELD:
                _HELD.discard(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)


def _close_in_child() -> None:
    """A forked child inherits the descriptors (``O_CLOEXEC`` covers ``exec`` only), and the
    blocks would stay taken until it exits: a DataLoader worker forked right after a save
    would hold the replaced checkpoint's space for an epoch. The child closes them at once."""
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
    _PENDING.clear()  # their threads are the parent's
    _LOCK.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_LOCK.acquire, after_in_parent=_LOCK.release, after_in_child=_close_in_child)


def file_system_type(path: str) -> str | None:
    """The type of the file system ``path`` is on, from the longest mount point above it in
    ``/proc/self/mountinfo``; None where that cannot be read (not Linux). Read once per
    directory and device: a save asks three times (its writes, commit and cleanup)."""
    real = os.path.realpath(path)
    try:
        device = os.stat(real).st_dev  # another file system mounted there: another device
    except OSError:
        device = None
    return _file_system_type(real, device)


@functools.lru_cache(maxsize=64)
def _file_system_type(real: str, device: int | None) -> str | None:
    try:
        with open("/proc/self/mountinfo") as f:
            text = f.read()
    except OSError:
        return None
    return mount_type(text, real)


def mount_type(mountinfo: str, path: str) -> str | None:
    """``file_system_type`` from ``mountinfo``'s text: each line's fifth field is a mount
    point (spaces written ``\\040``), and the field after the ``-`` its type."""
    best, found = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        point = fields[4].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, found = len(point), fields[fields.index("-", 6) + 1]
    return found
