"""A save that runs out of disk space: loud, cleaned up, and not sticky.

Every test here saves onto a real, small filesystem: a size-limited tmpfs mounted for the
test (needs root and permission to mount; skipped otherwise). Nothing is mocked: the
kernel answers ``write(2)`` with ENOSPC.

* a save that does not fit raises ``StorageFullError`` naming the checkpoint, the file and
  the bytes it needed (the OSError is its ``__cause__``); the previous checkpoint loads
  bit-exact; no data or temporary file of the failed save is left; the next save that fits
  succeeds (before: the failed save's partial files filled the disk, so it failed too);
* ``step{N}`` directories: a failed save leaves no directory behind;
* ``dcp.async_save``: the same, raised at ``.result()``;
* 2 gloo ranks: files of the failed save are removed on every rank, whichever rank ran out
  of space, even files a rank finished writing after another rank had failed.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItem

from dcp_ext import CheckpointError, ShardReader, ShardSavePlanner, ShardWriter, StorageFullError
from dcp_ext.formats.data_files import is_data_file
from dcp_ext.storage.commit import TEMP_FILE

from mp import run_job
from support import assert_state_dict_equal, load, save

pytestmark = pytest.mark.mp

DISK_BYTES = 1 << 20  # the tmpfs; every checkpoint below is sized against it
OLD, BIG, SMALL = 40_000, 250_000, 100_000  # float32 elements: 160 KB, 1 MB (never fits), 400 KB


def state(seed: int, numel: int, prefix: str = "") -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"{prefix}w": torch.randn(numel, generator=g), f"{prefix}b": torch.randn(7, generator=g).half(), f"{prefix}step": seed}


@pytest.fixture
def small_disk(tmp_path) -> str:
    """A fresh ``DISK_BYTES`` tmpfs, unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) on this machine")
    root = tmp_path / "disk"
    root.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(root)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield str(root)
    subprocess.run(["umount", "-l", str(root)], check=False)


def rank_error(exc: CheckpointException) -> BaseException:
    """The exception of the (first) failing rank inside DCP's CheckpointException."""
    return next(iter(exc.failures.values()))[0]


def assert_disk_full(error: BaseException, checkpoint: str) -> None:
    """The error names the checkpoint, a file in it and the bytes needed; the OSError is kept."""
    assert isinstance(error, StorageFullError), repr(error)
    assert isinstance(error, CheckpointError)
    text = str(error)
    assert checkpoint in text and "no space left on device" in text, text
    assert ".distcp" in text or ".metadata" in text or "dcp_ext" in text, text
    assert "needed" in text and "bytes" in text, text
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC, repr(error.__cause__)


def committed_files(path: str) -> set[str]:
    reader = ShardReader(path, cache_metadata=False)
    reader.read_metadata()
    return {item.relative_path for item in reader.catalog.items.values()}


def assert_only_committed(path: str) -> None:
    """Nothing of a failed save is left: only the live checkpoint's data files, no temps."""
    names = os.listdir(path)
    assert not [n for n in names if TEMP_FILE.match(n)], names
    assert {n for n in names if is_data_file(n)} == committed_files(path), names


def save_error(sd: dict, path: str, **writer_kwargs) -> BaseException:
    with pytest.raises(CheckpointException) as info:
        save(sd, path, **writer_kwargs)
    return rank_error(info.value)


# -- one process ----------------------------------------------------------------------------


def test_full_disk_keeps_the_old_checkpoint_and_the_next_save_succeeds(small_disk):
    path = os.path.join(small_disk, "ckpt")
    old = state(1, OLD)
    save(old, path)
    assert_disk_full(save_error(state(2, BIG), path), path)
    assert_state_dict_equal(load(old, path)[0], old)
    assert_only_committed(path)
    smaller = state(3, SMALL)
    save(smaller, path)  # fits once the failed save's files are gone
    assert_state_dict_equal(load(smaller, path)[0], smaller)
    assert_only_committed(path)


def test_failed_save_into_a_new_step_directory_leaves_no_directory(small_disk):
    old = state(1, OLD)
    save(old, os.path.join(small_disk, "step1"))
    step2 = os.path.join(small_disk, "step2")
    assert_disk_full(save_error(state(2, BIG), step2), step2)
    assert not os.path.exists(step2), os.listdir(step2)
    assert_state_dict_equal(load(old, os.path.join(small_disk, "step1"))[0], old)
    smaller = state(3, SMALL)
    save(smaller, os.path.join(small_disk, "step3"))
    assert_state_dict_equal(load(smaller, os.path.join(small_disk, "step3"))[0], smaller)


def test_async_save_that_runs_out_of_space(small_disk):
    path = os.path.join(small_disk, "ckpt")
    old = state(1, OLD)
    writer = ShardWriter(path)
    writer.async_save(old, planner=ShardSavePlanner()).result(timeout=60)
    fut = writer.async_save(state(2, BIG), planner=ShardSavePlanner())
    with pytest.raises(CheckpointException) as info:
        fut.result(timeout=60)
    assert_disk_full(rank_error(info.value), path)
    writer.staging.release()  # the big staging copy; the disk, not memory, is under test
    assert_state_dict_equal(load(old, path)[0], old)
    assert_only_committed(path)
    smaller = state(3, SMALL)
    with pytest.raises(CheckpointError, match="failed in the background"):  # reported once more
        writer.async_save(smaller, planner=ShardSavePlanner())
    writer.async_save(smaller, planner=ShardSavePlanner()).result(timeout=60)
    assert_state_dict_equal(load(smaller, path)[0], smaller)
    assert_only_committed(path)


# -- two ranks ------------------------------------------------------------------------------


class DelayedPlanner(ShardSavePlanner):
    """Holds rank ``late_rank``'s first write for ``delay`` seconds, so the other rank's write
    has failed (or finished) before it starts."""

    def __init__(self, late_rank: int, delay: float = 1.0):
        super().__init__()
        self.late_rank = late_rank
        self.delay = delay
        self._waited = False

    def resolve_data(self, write_item: WriteItem):
        if dist.get_rank() == self.late_rank and not self._waited:
            self._waited = True
            time.sleep(self.delay)
        return super().resolve_data(write_item)


def rank_state(rank: int, seed: int, numels: tuple[int, int]) -> dict:
    """Each rank saves its own keys, ``numels[rank]`` elements."""
    return state(seed + 10 * rank, numels[rank], prefix=f"rank{rank}.")


def two_rank_save(rank: int, path: str, seed: int, numels: tuple[int, int], planner: ShardSavePlanner | None = None):
    dcp.save(rank_state(rank, seed, numels), storage_writer=ShardWriter(path), planner=planner or ShardSavePlanner())


def two_rank_failure(rank: int, path: str, seed: int, numels: tuple[int, int], planner: ShardSavePlanner) -> None:
    with pytest.raises(CheckpointException) as info:
        two_rank_save(rank, path, seed, numels, planner)
    assert_disk_full(info.value.failures[1][0], path)  # rank 1 holds the big write
    dist.barrier()


def two_rank_load(rank: int, path: str, seed: int, numels: tuple[int, int]) -> None:
    want = rank_state(rank, seed, numels)
    assert_state_dict_equal(load(want, path)[0], want)


def disk_full_job(rank: int, world: int, root: str) -> None:
    path = os.path.join(root, "ckpt")
    old = (OLD // 4, OLD)
    two_rank_save(rank, path, 1, old)

    # 1. rank 1 runs out of space after rank 0 wrote its file: both ranks' files are gone at once
    two_rank_failure(rank, path, 2, (OLD // 4, BIG), DelayedPlanner(late_rank=1))
    if rank == 0:
        assert_only_committed(path)
    two_rank_load(rank, path, 1, old)

    # 2. rank 0 writes a big file after rank 1 failed (and cleaned up): it is left over until the
    #    next save, which removes it before writing, so a save that fits beside the old one succeeds
    two_rank_failure(rank, path, 3, (SMALL + SMALL // 2, BIG), DelayedPlanner(late_rank=0))
    two_rank_load(rank, path, 1, old)
    two_rank_save(rank, path, 4, (SMALL // 2, SMALL))
    dist.barrier()
    two_rank_load(rank, path, 4, (SMALL // 2, SMALL))
    if rank == 0:
        assert_only_committed(path)

    # 3. step directories: a save that fails in a new directory leaves no directory
    step = os.path.join(root, "step5")
    two_rank_failure(rank, step, 5, (OLD // 4, BIG), DelayedPlanner(late_rank=1))
    if rank == 0:
        assert not os.path.exists(step), os.listdir(step)
    two_rank_load(rank, path, 4, (SMALL // 2, SMALL))


def test_two_ranks_remove_a_failed_saves_files_everywhere(small_disk):
    run_job(disk_full_job, 2, small_disk)
