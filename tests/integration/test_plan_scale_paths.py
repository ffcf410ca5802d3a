"""The planning paths built for scale, run for real: 4 gloo processes, real files.

Save: ranks agree on table digests before DCP's gather, so the second save of an unchanged
HSDP layout sends no table and one hash per replica class (a few hundred bytes per rank),
and digests only the chunks another rank also holds;
a coordinator that lost its cache (a restart) gets every distinct table once and plans
afresh; a replica that differs is still refused under a reused plan. Every save loads back
bit-exact. Load: the index is decoded per key on demand, and a load of a subset of keys
matches the full decode.
"""

from __future__ import annotations

import itertools
import pickle
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.errors import InvalidRequestError, rank_failure
from dcp_ext.planning.plan_cache import clear_plan_cache

from mp import run_job
from support import assert_state_dict_equal, garbage_like, load_error, save


class _Probe(ShardSavePlanner):
    """Records what this rank's local plan puts on the wire."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.sent_bytes = len(pickle.dumps(plan))
        self.sent_table = plan.table is not None
        self.sent_hashes = plan.unit_hashes is not None
        return plan

    def _rows_to_digest(self, items, units):
        rows, marked = super()._rows_to_digest(items, units)
        self.digested = sorted(items[row].index.fqn for row in rows)
        return rows, marked


def _state(mesh, seed: int, skew_rank: int | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {
        "w": distribute_tensor(torch.randn(10, 6, generator=g), mesh, [Replicate(), Shard(0)], src_data_rank=None),
        "b": distribute_tensor(torch.randn(7, generator=g), mesh, [Replicate(), Shard(0)], src_data_rank=None),
        "norm": torch.randn(5, generator=g),
    }
    if skew_rank == torch.distributed.get_rank():  # this replica holds other data than its twin
        local = state["w"].to_local() + 1
        state["w"] = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)
    return state


def _local(state: dict) -> dict:
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def _save_and_check(mesh, path: str, seed: int) -> dict:
    state = _state(mesh, seed)
    planner = _Probe(group=torch.distributed.group.WORLD)
    dcp.save(state, storage_writer=ShardWriter(path), planner=planner)
    got = {
        k: distribute_tensor(garbage_like(v.full_tensor()), mesh, v.placements, src_data_rank=None)
        if isinstance(v, DTensor)
        else garbage_like(v)
        for k, v in state.items()
    }
    dcp.load(got, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
    assert_state_dict_equal(_local(got), _local(state))
    return {"bytes": planner.sent_bytes, "table": planner.sent_table, "hashes": planner.sent_hashes, "reused": planner.plan_reused,
            "digested": planner.digested}


def digest_job(rank: int, world_size: int, path: str) -> dict:
    clear_plan_cache()
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "fsdp"))
    out = {"first": _save_and_check(mesh, path, 1), "same": _save_and_check(mesh, path, 2)}
    if rank == 0:
        clear_plan_cache()  # the coordinator restarted; the other ranks still remember their units
    out["restarted"] = _save_and_check(mesh, path, 3)
    try:
        dcp.save(_state(mesh, 4, skew_rank=2), storage_writer=ShardWriter(path), planner=_Probe(group=torch.distributed.group.WORLD))
        out["skew"] = "saved"
    except CheckpointException as exc:
        out["skew"] = str(exc)
    if rank == 0:  # a save from one rank while the group exists: no exchange, so no wait for the others
        alone = {"norm": torch.arange(5.0)}
        dcp.save(alone, storage_writer=ShardWriter(f"{path}_alone"), planner=ShardSavePlanner(), no_dist=True)
        got = {"norm": garbage_like(alone["norm"])}
        dcp.load(got, storage_reader=ShardReader(f"{path}_alone"), planner=ShardLoadPlanner(), no_dist=True)
        out["alone"] = torch.equal(got["norm"], alone["norm"])
    torch.distributed.barrier()
    return out


@pytest.mark.mp
def test_unchanged_layout_sends_digests_and_a_restarted_coordinator_still_plans(tmp_path):
    results = run_job(digest_job, 4, str(tmp_path / "ckpt"))
    # ranks 0/2 and 1/3 are replicas (mesh dp x fsdp = 2 x 2): the lowest of each sends the table
    assert [r["first"]["table"] for r in results] == [True, True, False, False]
    assert [r["same"]["table"] for r in results] == [False] * 4
    assert [r["same"]["hashes"] for r in results] == [True] * 4
    assert results[0]["same"]["reused"] is True
    for r in results:
        assert r["same"]["bytes"] <= 1024, r
        assert r["same"]["bytes"] * 3 < r["first"]["bytes"] or not r["first"]["table"]
    # the restarted coordinator holds nothing: each distinct table travels once, plan made afresh
    assert [r["restarted"]["table"] for r in results] == [True, True, False, False]
    assert [r["restarted"]["hashes"] for r in results] == [False] * 4
    assert results[0]["restarted"]["reused"] is False
    for r in results:  # every chunk has a twin: all digested, also under the reused plan's units
        assert r["first"]["digested"] == r["same"]["digested"] == r["restarted"]["digested"] == ["b", "norm", "w"], r
    # rank 2 holds other data for the chunk rank 0 also holds: refused by the per-class hashes
    assert results[0]["alone"] is True
    for r in results:
        assert "different data" in r["skew"] and "'w'" in r["skew"] and "ranks [0]" in r["skew"], r["skew"]


def _mixed_state(mesh, seed: int, skew: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {
        "fsdp": distribute_tensor(torch.randn(6, 4, generator=g), mesh, [Shard(0)], src_data_rank=None),
        "rep": distribute_tensor(torch.randn(3, 2, generator=g), mesh, [Replicate()], src_data_rank=None),
        "plain": torch.randn(5, generator=g),
    }
    if skew and torch.distributed.get_rank() == 1:
        state["rep"] = DTensor.from_local(state["rep"].to_local() + 1, mesh, [Replicate()], run_check=False)
    return state


def held_alone_job(rank: int, world_size: int, path: str) -> dict:
    clear_plan_cache()
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict = {}
    for label, group in (("no group", None), ("group", torch.distributed.group.WORLD)):
        for save in ("first", "reused"):
            state = _mixed_state(mesh, len(out))
            planner = _Probe(group=group)
            dcp.save(state, storage_writer=ShardWriter(path), planner=planner)
            got = {k: distribute_tensor(garbage_like(v.full_tensor()), mesh, v.placements, src_data_rank=None)
                   if isinstance(v, DTensor) else garbage_like(v) for k, v in state.items()}
            dcp.load(got, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
            assert_state_dict_equal(_local(got), _local(state))
            out[f"{label} {save}"] = (planner.digested, planner.sent_hashes)
        try:
            dcp.save(_mixed_state(mesh, 9, skew=True), storage_writer=ShardWriter(path), planner=ShardSavePlanner(group=group))
            out[f"{label} skew"] = "saved"
        except CheckpointException as exc:
            out[f"{label} skew"] = str(exc)
    return out


def disagreeing_job(rank: int, world_size: int, path: str) -> dict:
    """Layouts where a rank holds a chunk of a DTensor sharded over every rank that another
    rank declares too: the marks that stand in for its digest tell the coordinator."""
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    world = init_device_mesh("cpu", (world_size,))
    own_order = DeviceMesh("cpu", [rank, *(r for r in range(world_size) if r != rank)])  # each rank sees itself first
    cases = {
        # 'w' a DTensor (its one row on rank 0) on rank 0, a plain tensor on rank 1: same data
        "key types": {"w": DTensor.from_local(torch.ones(1, 4), world, [Shard(0)], run_check=False, shape=(1, 4), stride=(4, 1))
                      if rank == 0 else torch.ones(1, 4)},
        # every rank at coordinate 0 of its mesh: all claim row 0
        "meshes": {"w": DTensor.from_local(torch.full((1, 3), float(rank)), own_order, [Shard(0)], run_check=False,
                                           shape=(1, 3), stride=(3, 1))},
        # a wrapper of local shards names its own offsets: its chunks are digested as ever
        "wrapper": {"w": DTensor.from_local(
            LocalShardsWrapper([torch.ones(2, 2), torch.full((2, 2), 2.0)], [(0, 0), (0, 2)]) if rank == 0
            else LocalShardsWrapper([torch.full((2, 2), 9.0)], [(0, 2)]),
            world, [Shard(1)], run_check=False, shape=(2, 4), stride=(4, 1))},
    }
    out = {}
    for label, state in cases.items():
        for group in (None, torch.distributed.group.WORLD):
            try:
                dcp.save(state, storage_writer=ShardWriter(f"{path}_{len(out)}"), planner=ShardSavePlanner(group=group))
                out[f"{label} {group is not None}"] = "saved"
            except CheckpointException as exc:
                out[f"{label} {group is not None}"] = str(exc)
    return out


@pytest.mark.mp
def test_a_chunk_held_alone_that_another_rank_declares_is_refused(tmp_path):
    results = run_job(disagreeing_job, 2, str(tmp_path / "ckpt"))
    for label, text in results[0].items():
        assert "'w' chunk at offsets" in text and "ranks [0] vs ranks [1]" in text, (label, text)
        marked = "hold it in a DTensor sharded over every rank" in text and "meshes, placements or key types disagree" in text
        assert marked is not label.startswith("wrapper"), (label, text)


@pytest.mark.mp
def test_chunks_of_a_dtensor_sharded_over_the_job_are_not_digested(tmp_path):
    """Only chunks another rank also declares are compared: a DTensor sharded over every
    rank has none, so its chunks cost no digest, whether or not the plan is reused."""
    results = run_job(held_alone_job, 2, str(tmp_path / "ckpt"))
    for r in results:
        for label in ("no group first", "no group reused", "group first", "group reused"):
            assert r[label][0] == ["plain", "rep"], (label, r)
        assert r["group reused"][1] is True  # the reused plan's hashes, over the units' rows
    for label in ("no group skew", "group skew"):
        assert "different data" in results[0][label] and "'rep'" in results[0][label], results[0][label]


# -- load: per-key decode of the index -------------------------------------------------------


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name) * 7919 + ord(name[0]))
    shapes = {"w": (10, 6), "m": (8, 9), "norm": (5,), "e": (4, 3, 2)}
    return torch.randn(*shapes[name], generator=g)


def index_save_job(rank: int, world_size: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    grid = init_device_mesh("cpu", (2, world_size // 2))
    state = {
        "w": distribute_tensor(_full("w"), mesh, [Shard(0)], src_data_rank=None),
        "m": distribute_tensor(_full("m"), grid, [Shard(0), Shard(1)], src_data_rank=None),
        "e": distribute_tensor(_full("e"), mesh, [Shard(1)], src_data_rank=None),
        "norm": _full("norm"),
        "step": {"count": 7},
    }
    dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner())


def subset_load_job(rank: int, world_size: int, path: str) -> dict:
    from torch.distributed.checkpoint.default_planner import (
        create_default_local_load_plan,
    )

    from dcp_ext.formats.safe_pickle import load_metadata_pickle
    from dcp_ext.planning.load_plan import local_reads, metadata_read_items
    from dcp_ext.storage.catalog import read_catalog
    from dcp_ext.storage.location import Location

    mesh = init_device_mesh("cpu", (world_size,))
    expected = {
        "m": distribute_tensor(_full("m"), mesh, [Shard(1)], src_data_rank=None),  # resharded: 2 x 2 -> 3 columns
        "e": distribute_tensor(_full("e"), mesh, [Shard(0)], src_data_rank=None),
        "norm": _full("norm"),
        # on ranks 0 and 1 only: rank 2 plans no read for it (nor for any key of its layout)
        "w": distribute_tensor(_full("w"), DeviceMesh("cpu", [0, 1]), [Shard(0)], src_data_rank=None),
    }
    got = {
        k: distribute_tensor(garbage_like(_full(k)), v.device_mesh, v.placements, src_data_rank=None) if isinstance(v, DTensor) else garbage_like(v)
        for k, v in expected.items()
    }
    dcp.load(got, storage_reader=ShardReader(path, cache_metadata=False), planner=ShardLoadPlanner())
    assert_state_dict_equal(_local(got), _local(expected))
    # the per-key decode plans exactly what DCP plans from the pickled .metadata
    keys = read_catalog(Location(path)).metadata.state_dict_metadata
    pickled = load_metadata_pickle(open(f"{path}/.metadata", "rb").read(), path)
    items, reads = local_reads(expected, keys, True, "ckpt")
    ours = items + reads.read_items()
    stock = create_default_local_load_plan(expected, pickled, True).items
    describe = lambda items: sorted(
        (i.dest_index.fqn, tuple(i.dest_index.offset), tuple(i.storage_index.offset), tuple(i.dest_offsets), tuple(i.storage_offsets), tuple(i.lengths))
        for i in items
    )
    assert describe(ours) == describe(stock), (describe(ours), describe(stock))
    # from the pickle: DCP's items exactly, in its order (DTensor chunks from a memo)
    assert metadata_read_items(expected, pickled, True) == stock
    assert metadata_read_items({**expected, "w": garbage_like(_full("w"))}, pickled, True)[-1].dest_index.fqn == "w"
    for state, strict, error in (({"missing": torch.zeros(2)}, True, RuntimeError), ({"norm": torch.zeros(3)}, True, ValueError)):
        with pytest.raises(error) as ours_error:
            metadata_read_items(state, pickled, strict)
        with pytest.raises(error) as stock_error:
            create_default_local_load_plan(state, pickled, strict)
        assert str(ours_error.value) == str(stock_error.value)
    assert metadata_read_items({"missing": torch.zeros(2)}, pickled, False) == []
    built = [name for name in ("w", "m", "e") if keys._built[keys._key_of[name]]]
    # a key this rank never asked for is never built; the full decode equals the pickle key by key
    equal = all(keys[k].chunks == pickled.state_dict_metadata[k].chunks for k in pickled.state_dict_metadata if k != "step.count")
    return {"built_before_full_decode": built, "equal": equal}


@pytest.mark.mp
def test_index_decoded_per_key_plans_like_dcp_and_loads_a_resharded_subset(tmp_path):
    path = str(tmp_path / "ckpt")
    run_job(index_save_job, 4, path)
    results = run_job(subset_load_job, 3, path)
    for r in results:
        assert r["built_before_full_decode"] == [], r  # planning read columns, built no chunk objects
        assert r["equal"] is True


def _grid_chunks(shape: torch.Size, rng: random.Random) -> list[ChunkStorageMetadata]:
    """Local chunks of a random grid over ``shape``: every dim cut at up to two random points."""
    cuts = [sorted({0, n, *(rng.randrange(1, n) for _ in range(rng.randrange(3)) if n > 1)}) for n in shape]
    spans = [list(itertools.pairwise(c)) for c in cuts]
    return [
        ChunkStorageMetadata(torch.Size([a for a, _ in box]), torch.Size([b - a for a, b in box]))
        for box in itertools.product(*spans)
    ]


@pytest.mark.mp
def test_overlaps_found_for_all_keys_at_once_are_the_read_items_dcp_plans(tmp_path, monkeypatch):
    """The local shards of every key are intersected together, in batches of one ndim
    (one shard's key per batch, or all); both give DCP's own read items, on random local
    grids over the saved 4-rank layouts."""
    from dcp_ext.formats.safe_pickle import load_metadata_pickle
    from dcp_ext.planning import load_plan
    from dcp_ext.storage.catalog import read_catalog
    from dcp_ext.storage.location import Location

    path = str(tmp_path / "ckpt")
    run_job(index_save_job, 4, path)
    keys = read_catalog(Location(path)).metadata.state_dict_metadata
    with open(f"{path}/.metadata", "rb") as f:
        pickled = load_metadata_pickle(f.read(), path).state_dict_metadata
    describe = lambda items: sorted(
        (i.dest_index.fqn, i.dest_index.index, tuple(i.dest_index.offset), i.storage_index.index, tuple(i.storage_index.offset),
         tuple(i.dest_offsets), tuple(i.storage_offsets), tuple(i.lengths))
        for i in items
    )
    rng = random.Random(5)
    for _ in range(20):
        grids = {fqn: _grid_chunks(pickled[fqn].size, rng) for fqn in ("w", "norm", "m", "e")}
        stock = describe(item for fqn, local in grids.items() for item in create_read_items_for_chunk_list(fqn, pickled[fqn], local))
        shards = [(fqn, i, chunk) for fqn, local in grids.items() for i, chunk in enumerate(local)]
        place = {(fqn, i): n for n, (fqn, i, _) in enumerate(shards)}
        for batch_rows in (1, load_plan.BATCH_ROWS):
            monkeypatch.setattr(load_plan, "BATCH_ROWS", batch_rows)
            ours = load_plan.tensor_reads(keys, shards).read_items()
            assert describe(ours) == stock, (batch_rows, grids)
            filled = [place[(item.dest_index.fqn, item.dest_index.index)] for item in ours]
            assert filled == sorted(filled), "read items in shard order, as DCP plans them"


@pytest.mark.mp
def test_an_index_in_several_row_groups_decodes_like_one(tmp_path):
    """Indexes written before this version hold several row groups; they decode the same."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dcp_ext.formats.index import INDEX_NAME, decode_index

    path = tmp_path / "ckpt"
    run_job(index_save_job, 4, str(path))
    data = (path / INDEX_NAME).read_bytes()
    table = pq.read_table(pa.BufferReader(data))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=3)
    split = sink.getvalue().to_pybytes()
    assert pq.ParquetFile(pa.BufferReader(split)).num_row_groups > 1
    one, several = decode_index(data, "one"), decode_index(split, "several")
    assert dict(several.items) == dict(one.items)
    assert {k: several.metadata.state_dict_metadata[k] for k in several.metadata.state_dict_metadata} == {
        k: one.metadata.state_dict_metadata[k] for k in one.metadata.state_dict_metadata
    }


def test_group_without_plan_caching_is_refused():
    with pytest.raises(InvalidRequestError, match="group= only applies with cache_plans=True"):
        ShardSavePlanner(group=object(), cache_plans=False)


def test_a_destination_that_does_not_fit_is_a_request_error_dcp_callers_catch(tmp_path):
    """The column planner raises DCP's messages as InvalidRequestError: the ValueError
    (size) and RuntimeError (missing key) DCP's planner raises, and a CheckpointError."""
    save({"w": torch.ones(4, 3)}, tmp_path)
    error = load_error({"w": torch.ones(4, 2)}, tmp_path)
    assert isinstance(error, InvalidRequestError) and isinstance(error, ValueError), repr(error)
    assert f"{tmp_path}: Size mismatch between saved torch.Size([4, 3]) and current: torch.Size([4, 2]) for w" in str(error)
    error = load_error({"w": torch.ones(4, 3), "x": torch.ones(1)}, tmp_path)
    assert isinstance(error, InvalidRequestError) and isinstance(error, RuntimeError), repr(error)
    assert f"{tmp_path}: Missing key in checkpoint state_dict: x." in str(error)  # which step_N directory


def replicated_with_step_job(rank: int, world_size: int, path: str) -> dict:
    """A replicated tensor beside a replicated non-tensor item (every real state dict has a
    step or param_groups), saved twice by one planner: the second save reuses the plan, and
    rank 1's tensor no longer matches rank 0's."""
    clear_plan_cache()
    planner = ShardSavePlanner(group=torch.distributed.group.WORLD)
    out = {}
    for save_number, skew in enumerate((0.0, 100.0 * rank)):
        state = {"b": torch.arange(6.0) + save_number + skew, "step": save_number}
        try:
            dcp.save(state, storage_writer=ShardWriter(f"{path}_{save_number}"), planner=planner)
            out[save_number] = ("saved", planner.plan_reused)
        except CheckpointException as exc:
            out[save_number] = (type(rank_failure(exc)).__name__, str(rank_failure(exc)))
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    state = {"n": distribute_tensor(torch.arange(6.0), mesh, [Replicate(), Replicate()])}
    # an option on rank 0 only; with cached plans the digest exchange's coordinator sees it first
    for option, cache in itertools.product(("check_replicas", "replica_locality"), (False, True)):
        options = {"cache_plans": cache, "check_replicas": True, option: rank == 0}  # locality needs the check
        try:
            dcp.save(state, storage_writer=ShardWriter(f"{path}_{option}_{cache}"), planner=ShardSavePlanner(**options))
            out[option, cache] = "saved"
        except CheckpointException as exc:
            out[option, cache] = str(rank_failure(exc))
    return out


@pytest.mark.mp
def test_a_replicated_non_tensor_item_leaves_the_check_of_a_reused_plan_on(tmp_path):
    """A non-tensor row had a zero digest, which made its whole set of chunks (everything
    two ranks both hold) unknown: under a reused plan the check of every replicated tensor
    was off, and rank 1 loaded rank 0's values. And options that must agree across ranks
    are refused by name: check_replicas on one rank compared nothing; replica_locality on
    one rank failed with a bare TypeError, or silently kept no copies."""
    for result in run_job(replicated_with_step_job, 2, str(tmp_path / "ckpt")):
        assert result[0] == ("saved", False)
        kind, message = result[1]
        assert kind == "ReplicaMismatchError" and "'b'" in message and "cached plan" in message, message
        for option, cache in itertools.product(("check_replicas", "replica_locality"), (False, True)):
            assert result[option, cache] == (
                f"ShardSavePlanner({option}=...) differs across ranks: ranks [0] pass {option}=True, "
                f"ranks [1] False; pass the same planner options on every rank"), (option, cache, result[option, cache])
