"""The files a commit retires leave the directory before ``dcp.save`` returns, and their
space comes back once a thread has closed them (``storage.cleanup``): the save does not
wait for it, ``ShardWriter.close()`` and the next save into the directory do. Where the
file system would show an open unlinked file (NFS, FUSE), each is removed in turn."""

from __future__ import annotations

import os
import threading

import pytest
import torch.distributed.checkpoint as dcp

from dcp_ext import ShardSavePlanner, ShardWriter
from dcp_ext.formats.data_files import is_data_file
from dcp_ext.storage import cleanup
from support import assert_state_dict_equal, load, sample_state


def _data_files(path) -> set[str]:
    return {name for name in os.listdir(path) if is_data_file(name)}


def _held_unlinked(path) -> set[str]:
    """Names of files under ``path`` this process holds open after they were unlinked."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{os.path.realpath(path)}/") and target.endswith(" (deleted)"):
            held.add(os.path.basename(target.removesuffix(" (deleted)")))
    return held


def _save(state: dict, path) -> ShardWriter:
    writer = ShardWriter(path, thread_count=2)
    dcp.save(state, storage_writer=writer, planner=ShardSavePlanner())
    return writer


def _first_save_and_held_closes(path, monkeypatch) -> tuple[set[str], threading.Event]:
    """A first save into ``path`` (its data files returned), and the retired files' closing
    held until the event returned is set (then the real one runs); skipped where the file
    system takes retired files out in turn."""
    if cleanup.file_system_type(str(path.parent)) not in cleanup.DEFERS_FREEING:
        pytest.skip(f"{cleanup.file_system_type(str(path.parent))}: retired files are removed in turn there")
    _save(sample_state(1), path).close()
    release = threading.Event()
    close_all = cleanup._close_all

    def held_close_all(fds):
        assert release.wait(timeout=60)
        close_all(fds)

    monkeypatch.setattr(cleanup, "_close_all", held_close_all)
    return _data_files(path), release


def test_retired_files_leave_at_once_and_their_space_comes_back_on_a_thread(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    old, release = _first_save_and_held_closes(path, monkeypatch)
    second = sample_state(2)
    writer = _save(second, path)
    new = _data_files(path)
    assert new and not new & old  # the directory holds the committed files only
    assert {name for name in _held_unlinked(path) if is_data_file(name)} == old  # their space not given back yet
    assert_state_dict_equal(load(second, path, cache_metadata=False)[0], second)
    third = sample_state(3)
    next_save = threading.Thread(target=lambda: _save(third, path).close())
    next_save.start()
    next_save.join(timeout=0.5)
    assert next_save.is_alive()  # the next save waits for the space before it lists the directory
    release.set()
    next_save.join(timeout=60)
    assert not next_save.is_alive()
    writer.close()
    assert _held_unlinked(path) == set()
    assert not _data_files(path) & (old | new)
    assert_state_dict_equal(load(third, path, cache_metadata=False)[0], third)


def test_where_an_open_unlinked_file_would_show_each_is_removed_in_turn(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    _save(sample_state(1), path).close()
    old = _data_files(path)
    monkeypatch.setattr(cleanup, "file_system_type", lambda root: "nfs4")
    second = sample_state(2)
    _save(second, path)
    assert not _data_files(path) & old and _held_unlinked(path) == set()
    assert_state_dict_equal(load(second, path, cache_metadata=False)[0], second)


MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
31 27 0:41 / /mnt/shared\040data rw,relatime shared:7 - nfs4 server:/export rw,vers=4.2
32 31 0:42 / /mnt/shared\040data/scratch rw,relatime - xfs /dev/vdb rw
40 27 0:50 / /mnt/bucket rw,nosuid - fuse.gcsfuse bucket rw
"""


def test_the_file_system_of_a_path_is_its_longest_mount_point():
    assert cleanup.mount_type(MOUNTINFO, "/tmp/ckpt") == "ext4"
    assert cleanup.mount_type(MOUNTINFO, "/mnt/shared data/run1") == "nfs4"
    assert cleanup.mount_type(MOUNTINFO, "/mnt/shared data/scratch/run1") == "xfs"
    assert cleanup.mount_type(MOUNTINFO, "/mnt/shared data/scratchpad") == "nfs4"  # a prefix is not a mount point
    assert cleanup.mount_type(MOUNTINFO, "/mnt/bucket/ckpt") == "fuse.gcsfuse"
    assert cleanup.mount_type("", "/tmp") is None
    assert {"nfs4", "fuse.gcsfuse"}.isdisjoint(cleanup.DEFERS_FREEING)


def test_a_retired_file_this_process_may_not_open_is_removed_in_turn(tmp_path, monkeypatch):
    """Unlinking needs write access to the directory only: a file the process cannot open
    (another user's, mode 600) is still retired, removed at once."""
    path = tmp_path / "ckpt"
    _save(sample_state(1), path).close()
    old = sorted(_data_files(path))
    refused = os.path.join(os.path.realpath(path), old[0])
    open_file = os.open

    def refusing_open(file, flags, *args, **kwargs):
        if os.path.realpath(file) == refused:
            raise PermissionError(13, "Permission denied", file)
        return open_file(file, flags, *args, **kwargs)

    monkeypatch.setattr(cleanup.os, "open", refusing_open)
    second = sample_state(2)
    _save(second, path)
    monkeypatch.setattr(cleanup.os, "open", open_file)
    assert not _data_files(path) & set(old)
    assert {name for name in _held_unlinked(path) if is_data_file(name)} <= set(old[1:])
    assert_state_dict_equal(load(second, path, cache_metadata=False)[0], second)


def test_a_process_forked_before_the_space_came_back_does_not_keep_it(tmp_path, monkeypatch):
    """A child forked while the retired files are still open (a DataLoader worker started
    right after a save) closes its copies at once: it would otherwise keep their blocks
    until it exits."""
    path = tmp_path / "ckpt"
    old, release = _first_save_and_held_closes(path, monkeypatch)
    writer = _save(sample_state(2), path)
    assert {name for name in _held_unlinked(path) if is_data_file(name)} == old
    pid = os.fork()
    if pid == 0:  # the child: nothing retired held; it never returns into pytest
        code = 1
        try:
            code = 0 if not _held_unlinked(path) and not cleanup._HELD else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    release.set()
    writer.close()
    assert os.waitstatus_to_exitcode(status) == 0
    assert _held_unlinked(path) == set()
