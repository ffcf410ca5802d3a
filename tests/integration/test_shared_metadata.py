"""``ShardReader(share_metadata=True)``: one rank of the group reads the metadata files.

Every worker reads the checkpoint through ``metered://`` (``support.MeteredFileSystem``,
the real local filesystem behind fsspec, counting per process the bytes it serves); loads land
bit-exact in garbage; errors reach every rank instead of leaving some waiting.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import CheckpointError, InvalidRequestError, ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter

from mp import run_job
from support import MeteredFileSystem, assert_tensor_equal, garbage_like, make_globals

METADATA_FILES = (".metadata", ".dcp_ext_index.parquet", ".dcp_ext_commit")
SPECS = {"w": ((12, 5), torch.float32), "b": ((7,), torch.bfloat16), "i": ((9, 2), torch.int64)}




def save_job(rank: int, world: int, url: str, seed: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in make_globals(SPECS, seed).items()}
    dcp.save(state, storage_writer=ShardWriter(url), planner=ShardSavePlanner())


def load_job(rank: int, world: int, url: str, seed: int, loads: int = 1) -> list[tuple[int, int]]:
    """``loads`` loads into garbage; per load, (metadata bytes served to this rank, reads counted)."""
    mesh = init_device_mesh("cpu", (world,))
    want = make_globals(SPECS, seed)
    out = []
    for _ in range(loads):
        MeteredFileSystem.reset()
        state = {k: distribute_tensor(garbage_like(v), mesh, [Shard(0)], src_data_rank=None) for k, v in want.items()}
        reader = ShardReader(url, share_metadata=True)
        dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
        for key, value in want.items():
            expected = distribute_tensor(value, mesh, [Shard(0)], src_data_rank=None).to_local()
            assert_tensor_equal(state[key].to_local(), expected, f"rank {rank} {key}")
        out.append((sum(MeteredFileSystem.served(name) for name in METADATA_FILES), reader.stats.metadata_reads))
    return out


@pytest.mark.mp
def test_one_rank_reads_the_metadata_and_every_rank_loads_bit_exact(tmp_path):
    url = f"metered://{tmp_path}/ckpt"
    run_job(save_job, 2, url, 1)
    first, again = zip(*run_job(load_job, 4, url, 1, 2))
    assert first[0][0] >= os.path.getsize(tmp_path / "ckpt" / ".metadata")  # rank 0 streamed .metadata
    assert [served for served, _ in first[1:]] == [0, 0, 0] and [reads for _, reads in first] == [1, 0, 0, 0]
    assert all(served == 0 for served, _ in again[1:]) and [reads for _, reads in again] == [0] * 4  # cached
    run_job(save_job, 2, url, 2)  # a new version in place: read once more, new values everywhere
    assert [reads for _, reads in (r[0] for r in run_job(load_job, 4, url, 2))] == [1, 0, 0, 0]


@pytest.mark.mp
def test_a_stock_checkpoint_is_shared_too(tmp_path):
    path = str(tmp_path / "stock")
    dcp.save(make_globals(SPECS, 3), storage_writer=dcp.FileSystemWriter(path))
    results = run_job(load_job, 2, f"metered://{path}", 3)
    assert [r[0][0] > 0 for r in results] == [True, False]  # the pickle itself was sent


def _error_job(rank: int, world: int, urls: list[str]) -> str:
    """Load ``urls[rank % len(urls)]``; the error this rank got (DCP reports a failed
    ``read_metadata`` as an AssertionError quoting it)."""
    state = {"w": garbage_like(torch.zeros(12, 5))}
    try:
        dcp.load(state, storage_reader=ShardReader(urls[rank % len(urls)], share_metadata=True))
    except dcp.api.CheckpointException as exc:
        error = next(iter(exc.failures.values()))[0]
    except CheckpointError as exc:
        error = exc
    else:
        return "loaded"
    return f"{type(error).__name__}: {error}"


@pytest.mark.mp
def test_ranks_opening_different_checkpoints_all_raise(tmp_path):
    urls = [str(tmp_path / "A"), str(tmp_path / "B")]
    for n, url in enumerate(urls):
        dcp.save(make_globals(SPECS, n), storage_writer=ShardWriter(url), planner=ShardSavePlanner())
    messages = run_job(_error_job, 4, urls)
    assert len(set(messages)) == 1 and "different checkpoints" in messages[0] and all(u in messages[0] for u in urls)


@pytest.mark.mp
def test_a_failure_of_the_reading_rank_reaches_every_rank(tmp_path):
    messages = run_job(_error_job, 3, [str(tmp_path / "nothing")])
    assert len(set(messages)) == 1 and "no committed checkpoint here" in messages[0], messages
    save_file({"w": torch.zeros(12, 5)}, str(tmp_path / "model.safetensors"))
    messages = run_job(_error_job, 2, [str(tmp_path)])
    assert len(set(messages)) == 1 and "share_metadata" in messages[0] and "safetensors" in messages[0], messages


def _groups_job(rank: int, world: int, urls: list[str]) -> int:
    """Ranks {0,1} load A and {2,3} load B, each dcp.load on its own group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    want = make_globals(SPECS, rank // 2)
    state = {k: garbage_like(v) for k, v in want.items()}
    reader = ShardReader(urls[rank // 2], share_metadata=True, group=group)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner(), process_group=group)
    for key, value in want.items():
        assert_tensor_equal(state[key], value, f"rank {rank} {key}")
    return reader.stats.metadata_reads


@pytest.mark.mp
def test_each_group_shares_its_own_checkpoint(tmp_path):
    urls = [str(tmp_path / "A"), str(tmp_path / "B")]
    for n, url in enumerate(urls):
        dcp.save(make_globals(SPECS, n), storage_writer=ShardWriter(url), planner=ShardSavePlanner())
    assert run_job(_groups_job, 4, urls) == [1, 0, 1, 0]


def test_options_that_cannot_take_effect_are_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="group"):
        ShardReader(tmp_path, group=object())  # neither two_stage nor share_metadata
    dcp.save(make_globals(SPECS, 0), storage_writer=ShardWriter(tmp_path), planner=ShardSavePlanner())
    with pytest.raises(InvalidRequestError, match="share_metadata=True.*process group"):
        ShardReader(tmp_path, share_metadata=True).read_metadata()
