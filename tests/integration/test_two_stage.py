"""Two-stage loading: each stored byte is read once per group, then exchanged (gloo)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import CheckpointError, ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.storage.catalog import read_catalog
from dcp_ext.storage.location import Location

from mp import run_job
from support import assert_tensor_equal, garbage_like

pytestmark = pytest.mark.mp

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


def _two_stage_error(state: dict, reader: ShardReader, group=None) -> str:
    """Load expecting failure; the rank's original error (DCP wraps it in CheckpointException)."""
    try:
        dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner(), process_group=group)
    except BaseException as exc:
        failures = getattr(exc, "failures", {})
        original = next(iter(failures.values()))[0] if failures else exc
        assert isinstance(original, CheckpointError), repr(original)
        return str(original)
    raise AssertionError("load unexpectedly succeeded")


def _load_expecting_failure(rank: int, world: int, path: str, lost_keys: list[str]) -> str:
    """Only rank 2 needs the keys of the lost file: only its planning fails."""
    full = full_tensors()
    state = {k: garbage_like(v) for k, v in full.items() if rank == 2 or k not in lost_keys}
    return _two_stage_error(state, ShardReader(path, two_stage=True))


def test_one_rank_failing_makes_every_rank_raise_the_same_error(tmp_path):
    _save_plain(str(tmp_path))
    catalog = read_catalog(Location(str(tmp_path)))
    victim = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))[0]
    lost = sorted({index.fqn for index, item in catalog.items.items() if item.relative_path == victim})
    os.unlink(tmp_path / victim)
    messages = run_job(_load_expecting_failure, 4, str(tmp_path), lost, timeout=120)
    assert all("rank 2" in m and victim in m and "missing" in m for m in messages)
    assert len({m.split(": two-stage", 1)[1] for m in messages}) == 1  # same failure everywhere


def _load_with_a_corrupt_record(rank: int, world: int, path: str) -> str:
    """Only rank 0 needs 'a'; a budget of 1 KiB makes several exchange batches."""
    state = {"b": garbage_like(torch.arange(16.0))} | ({"a": garbage_like(torch.arange(64.0))} if rank == 0 else {})
    return _two_stage_error(state, ShardReader(path, two_stage=True, verify_checksums=True, exchange_budget_bytes=1024))


def test_a_checksum_failure_on_one_rank_mid_exchange_fails_every_rank(tmp_path):
    """A piece fails its checksum as it lands, on the one rank that needs it; the others were
    already in the next batch's collective and waited there forever (found by a fault sweep)."""
    dcp.save({"a": torch.arange(64.0), "b": torch.arange(16.0)}, storage_writer=ShardWriter(tmp_path),
             planner=ShardSavePlanner(), no_dist=True)
    catalog = read_catalog(Location(str(tmp_path)))
    [item] = [item for index, item in catalog.items.items() if index.fqn == "a"]
    with open(tmp_path / item.relative_path, "r+b") as f:  # one payload byte of 'a' flipped
        f.seek(item.payload_offset + 5)  # absolute in the file
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))
    messages = run_job(_load_with_a_corrupt_record, 2, str(tmp_path), timeout=60)
    assert all("rank 0: ChecksumMismatchError" in m and "key 'a'" in m for m in messages), messages


def _groups_load_their_own_checkpoints(rank: int, world: int, paths: list[str], exchange: str) -> str:
    """Ranks {0,1} load checkpoint A and {2,3} checkpoint B, each dcp.load on its own group;
    the exchange runs in the load's group (``own``), the default one or the whole job given
    explicitly (``world``)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    full = {k: v + rank // 2 for k, v in full_tensors().items()}
    state = {k: garbage_like(v) for k, v in full.items()}
    reader = ShardReader(paths[rank // 2], two_stage=True, group={"own": group, "default": None, "world": dist.group.WORLD}[exchange])
    if exchange != "own":
        return _two_stage_error(state, reader, group)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner(), process_group=group)
    for name, value in state.items():
        assert_tensor_equal(value, full[name], f"rank {rank} {name}")
    return "loaded"


def test_groups_loading_different_checkpoints_never_mix(tmp_path):
    """Stock-written A and B share file names; an exchange across both groups would mix
    them. With the whole job as the exchange group every rank raises the same error;
    without group= every rank is refused before any exchange (dcp.load runs on a
    sub-group); with its own group each loads its own."""
    paths = [str(tmp_path / "A"), str(tmp_path / "B")]
    for n, path in enumerate(paths):
        dcp.save({k: v + n for k, v in full_tensors().items()}, storage_writer=dcp.FileSystemWriter(path))
    messages = run_job(_groups_load_their_own_checkpoints, 4, paths, "world", timeout=120)
    assert len(set(messages)) == 1 and "load different checkpoints" in messages[0], messages
    assert all(p in messages[0] for p in paths)
    messages = run_job(_groups_load_their_own_checkpoints, 4, paths, "default", timeout=120)
    assert all("dcp.load runs on a sub-group" in m for m in messages), messages
    assert run_job(_groups_load_their_own_checkpoints, 4, paths, "own", timeout=120) == ["loaded"] * 4


def _subgroup_load_of_one_checkpoint(rank: int, world: int, path: str) -> str:
    group = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    state = {k: garbage_like(v) for k, v in full_tensors().items()}
    return _two_stage_error(state, ShardReader(path, two_stage=True), group)


def test_default_exchange_group_must_be_the_load_group(tmp_path):
    """Both groups load the same checkpoint on their own group, without group=: the
    default exchange (the whole job) is not dcp.load's group, refused alike everywhere."""
    _save_plain(str(tmp_path))
    messages = run_job(_subgroup_load_of_one_checkpoint, 4, str(tmp_path), timeout=120)
    assert len(set(messages)) == 1 and "dcp.load runs on a sub-group" in messages[0], messages


def _part_of_the_job_loads(rank: int, world: int, path: str, members: list[int]) -> str:
    """Only ``members`` load, on their own group; the other rank does something else."""
    group = dist.new_group(members)
    if rank not in members:
        return "idle"
    state = {k: garbage_like(v) for k, v in full_tensors().items()}
    return _two_stage_error(state, ShardReader(path, two_stage=True), group)


@pytest.mark.parametrize("members", [[1, 2], [0, 1]], ids=["ranks-renumbered", "ranks-0-and-1"])
def test_a_sub_group_load_without_group_is_refused_not_left_waiting(tmp_path, members):
    """Before, the loading ranks waited in the whole job's first exchange for a rank that
    never joins. Ranks 1, 2 are ranks 0, 1 of their group (each rank sees it); ranks 0, 1
    keep their numbers, and DCP's coordinator sees two plans in a job of three."""
    _save_plain(str(tmp_path))
    messages = run_job(_part_of_the_job_loads, 3, str(tmp_path), members, timeout=120)
    assert all(("dcp.load runs on a sub-group" in m) == (rank in members) for rank, m in enumerate(messages)), messages


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


def _ranks_give_different_options(rank: int, world: int, path: str, variant: str) -> str:
    """``budget``: each rank its own exchange budget (sized from its host's free memory,
    say): the ranks batched by their own budgets, made different numbers of collectives and
    all waited until the timeout. ``mixed``: two_stage on rank 0 only: its exchange paired
    with DCP's own gather on rank 1, which returned while rank 0 waited.
    ``stock_coordinator``: the same with a stock reader at the coordinator."""
    full = full_tensors()
    state = {k: garbage_like(v) for k, v in full.items()}
    if variant == "budget":
        dcp.load(state, storage_reader=ShardReader(path, two_stage=True, exchange_budget_bytes=(16 << 10) << (6 * rank)))
        for name, value in state.items():
            assert_tensor_equal(value, full[name], name)
        return "loaded"
    reader = ShardReader(path, two_stage=rank == 0)
    if variant == "stock_coordinator":  # nothing at the coordinator checks the modes
        reader = dcp.FileSystemReader(path) if rank == 0 else ShardReader(path, two_stage=True)
    try:
        dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    except BaseException as exc:
        return str(next(iter(exc.failures.values()))[0])
    return "loaded"


def test_ranks_with_different_budgets_or_modes_end_together(tmp_path):
    _save_plain(str(tmp_path))
    assert run_job(_ranks_give_different_options, 2, str(tmp_path), "budget", timeout=60) == ["loaded", "loaded"]
    messages = run_job(_ranks_give_different_options, 2, str(tmp_path), "mixed", timeout=60)
    assert all("two_stage=True) on ranks [0] of dcp.load's group but not on ranks [1]" in m for m in messages), messages
    messages = run_job(_ranks_give_different_options, 2, str(tmp_path), "stock_coordinator", timeout=60)
    assert all("coordinator did not confirm that every rank of its group exchanges" in m for m in messages), messages
