"""Two-stage loading: each stored byte is read once per group, then exchanged (gloo)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import CheckpointError, ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from mp import assert_tensor_equal, garbage_like, run_job

SHAPES = {"emb": (256, 64), "w1": (128, 96), "w2": (96, 128), "norm": (64,)}


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _save_plain(path: str) -> None:
    dcp.save(full_tensors(), storage_writer=ShardWriter(path), planner=ShardSavePlanner())


def _load(rank: int, world: int, path: str, two_stage: bool, layout: str) -> tuple[int, int]:
    """Load into ``layout`` ('dp': full tensors everywhere, 'tp2dp2': (dp, tp) mesh,
    'cols': Shard(1) over all ranks); check bit-exact; return (bytes read, needed bytes)."""
    full = full_tensors()
    if layout == "dp":
        state = {k: garbage_like(v) for k, v in full.items()}
        expected = full
    else:
        mesh = init_device_mesh("cpu", (2, 2) if layout == "tp2dp2" else (world,))

        def placements(t: torch.Tensor) -> list:
            return [Replicate(), Shard(0)] if layout == "tp2dp2" else [Shard(t.dim() - 1)]

        state = {k: distribute_tensor(v, mesh, placements(v)) for k, v in full.items()}
        expected = {k: v.to_local().clone() for k, v in state.items()}
        for v in state.values():
            v.to_local().copy_(garbage_like(v.to_local()))
    reader = ShardReader(path, two_stage=two_stage)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        assert_tensor_equal(local, expected[name], name)
    return reader.stats.bytes_read, sum(v.numel() * v.element_size() for v in expected.values())


def _unique_payload() -> int:
    return sum(t.numel() * t.element_size() for t in full_tensors().values())


def _traffic(path: str, layout: str, two_stage: bool) -> int:
    results = run_job(_load, 4, path, two_stage, layout)
    return sum(read for read, _ in results)


@pytest.mark.parametrize("layout,copies", [("dp", 4), ("tp2dp2", 2)])
def test_each_stored_byte_is_read_once_per_group(tmp_path, layout, copies):
    """DP=4 (every rank needs everything) and TP=2 x DP=2 (each TP shard needed twice)."""
    _save_plain(str(tmp_path))
    unique = _unique_payload()
    plain = _traffic(str(tmp_path), layout, False)
    staged = _traffic(str(tmp_path), layout, True)
    assert plain >= 0.95 * copies * unique
    assert unique <= staged <= 1.05 * unique


def test_resharded_two_stage_load_sends_only_needed_slices(tmp_path):
    _save_plain(str(tmp_path))  # whole tensors; every rank needs a column slice of each
    results = run_job(_load, 4, str(tmp_path), True, "cols")
    assert sum(read for read, _ in results) <= 1.05 * _unique_payload()


def _load_expecting_failure(rank: int, world: int, paths: list[str]) -> str:
    full = full_tensors()
    state = {k: garbage_like(v) for k, v in full.items()}
    try:
        dcp.load(state, storage_reader=ShardReader(paths[rank], two_stage=True), planner=ShardLoadPlanner())
    except BaseException as exc:  # DCP wraps our CheckpointError in CheckpointException
        failures = getattr(exc, "failures", {})
        original = next(iter(failures.values()))[0] if failures else exc
        assert isinstance(original, CheckpointError), repr(original)
        return str(original)
    raise AssertionError("load unexpectedly succeeded")


def test_one_rank_failing_makes_every_rank_raise_the_same_error(tmp_path):
    _save_plain(str(tmp_path / "ckpt"))
    paths = []
    for rank in range(4):  # each rank its own copy; rank 2's copy loses a data file
        copy = tmp_path / f"rank{rank}"
        shutil.copytree(tmp_path / "ckpt", copy)
        paths.append(str(copy))
    victim = sorted(n for n in os.listdir(paths[2]) if n.endswith(".distcp"))[0]
    os.unlink(os.path.join(paths[2], victim))
    messages = run_job(_load_expecting_failure, 4, paths, timeout=120)
    assert all("rank 2" in m and victim in m and "missing" in m for m in messages)
    assert len({m.split(": two-stage", 1)[1] for m in messages}) == 1  # same failure everywhere


def _load_everything(rank: int, world: int, path: str, variant: str) -> int:
    """Every rank loads all tensors with a two-stage reader; returns bytes read from storage.

    ``groups``: two independent DP groups {0,1} and {2,3}, each reading everything once.
    ``small_batches``: a 48 KiB budget, so many batches, each read while the previous one
    is exchanged.
    """
    if variant == "groups":
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        options = {"group": groups[rank // 2]}
    else:
        options = {"exchange_budget_bytes": 48 << 10}
    full = full_tensors()
    state = {k: garbage_like(v) for k, v in full.items()}
    reader = ShardReader(path, two_stage=True, **options)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    for name, value in state.items():
        assert_tensor_equal(value, full[name], name)
    return reader.stats.bytes_read


def test_explicit_group_reads_once_per_group(tmp_path):
    _save_plain(str(tmp_path))
    reads = run_job(_load_everything, 4, str(tmp_path), "groups")
    unique = _unique_payload()
    assert unique <= reads[0] + reads[1] <= 1.05 * unique
    assert unique <= reads[2] + reads[3] <= 1.05 * unique


def test_many_small_batches_overlap_reading_and_sending(tmp_path):
    _save_plain(str(tmp_path))
    reads = run_job(_load_everything, 4, str(tmp_path), "small_batches")
    unique = _unique_payload()
    assert unique <= sum(reads) <= 1.05 * unique
