"""Checkpoint placements for EP + FSDP2 parameters: experts keep their global place.

An expert parameter wrapped by FSDP2 is a DTensor on the EDP mesh only, and its name
carries the EP-local index, so without a correction every EP rank declares the same
chunk and DCP keeps one of them. The placement function rebuilds the DTensor on the
checkpoint mesh (EP, and FSDP as a strided shard of it).

Every parameter's data is a slice of a deterministic "natural" global tensor (expert e's
rows before expert e+1's), so a chunk written or loaded at the wrong offsets shows up as
a bit-level difference. Values never equal the -7777 garbage loads start from.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import (
    ReplicaMismatchError,
    ShardLoadPlanner,
    ShardReader,
    ShardSavePlanner,
    ShardWriter,
    with_checkpoint_placements,
)

from mp import run_job
from support import assert_tensor_equal, digest_rows, garbage_like, global_plan, shard_item

EXPERTS = [f"layers.{i}.mlp.experts.fc1.weight0" for i in range(4)]
EVEN, UNEVEN = "layers.0.mlp.experts.fc1.weight0", "layers.0.mlp.experts.fc2.weight0"
EP_LOCAL_ROWS = {EVEN: 8, UNEVEN: 5}  # UNEVEN splits 3/2 over FSDP


def natural(name: str, rows: int, cols: int = 3) -> torch.Tensor:
    """The natural global tensor of ``name``: distinct values per key and row."""
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 1000.0 * (zlib.crc32(name.encode()) % 97)


def by_ep(mesh: DeviceMesh, shard_axes: tuple[str, ...] = ("ep",)):
    """placement_fn: experts shard dim 0 over ``shard_axes``, everything else untouched."""

    def placement_fn(fqn: str, tensor: torch.Tensor):
        if ".experts." not in fqn:
            return None
        return [Shard(0) if name in shard_axes else Replicate() for name in mesh.mesh_dim_names]

    return placement_fn


def chunks(path: str, names) -> dict:
    """key -> (global size, sorted [(offsets, sizes)]) from the saved metadata."""
    md = ShardReader(path).read_metadata()
    return {
        n: (tuple(md.state_dict_metadata[n].size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[n].chunks))
        for n in names
    }


def failure(exc: CheckpointException) -> BaseException:
    return next(iter(exc.failures.values()))[0]


def garbage_fill(state: dict) -> None:
    for value in state.values():
        local = value.to_local() if isinstance(value, DTensor) else value
        local.copy_(garbage_like(local))


# -- EP=2 over a singleton FSDP mesh ------------------------------------------------------


def a1_state(rank: int, fsdp: DeviceMesh) -> dict[str, DTensor]:
    """EP=2, singleton FSDP mesh: each rank's (4, 3) block is rows [4e, 4e+4) of the natural (8, 3)."""
    return {
        name: DTensor.from_local(natural(name, 8)[4 * rank : 4 * rank + 4].clone(), fsdp, [Shard(0)])
        for name in EXPERTS
    }


def a1_job(rank: int, world: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))
    fn = by_ep(mesh)
    out: dict = {}

    # Stock planners: every rank declares offsets (0, 0); dedup keeps one writer per key.
    state = a1_state(rank, mesh["edp"])
    dcp.save(state, storage_writer=ShardWriter(f"{root}/stock"), planner=DefaultSavePlanner())
    garbage_fill(state)
    dcp.load(state, storage_reader=ShardReader(f"{root}/stock"), planner=DefaultLoadPlanner())
    expected = a1_state(rank, mesh["edp"])
    out["stock_wrong"] = [n for n in EXPERTS if not torch.equal(state[n].to_local(), expected[n].to_local())]

    # Our planner without placements refuses instead of writing that checkpoint...
    state = a1_state(rank, mesh["edp"])
    try:
        dcp.save(state, storage_writer=ShardWriter(f"{root}/refused"), planner=ShardSavePlanner())
    except CheckpointException as exc:
        out["refused"] = failure(exc)
    # ...also for keys the placement_fn leaves alone, and then it names the mesh.
    half = lambda fqn, t: fn(fqn, t) if fqn in EXPERTS[:2] else None  # noqa: E731
    try:
        dcp.save(state, storage_writer=ShardWriter(f"{root}/half"), planner=ShardSavePlanner(placement_fn=half, mesh=mesh))
    except CheckpointException as exc:
        out["half"] = failure(exc)

    # With placements: each rank's block gets its own offsets and comes back to its owner.
    state = a1_state(rank, mesh["edp"])
    dcp.save(state, storage_writer=ShardWriter(f"{root}/ours"), planner=ShardSavePlanner(placement_fn=fn, mesh=mesh))
    garbage_fill(state)
    dcp.load(state, storage_reader=ShardReader(f"{root}/ours"), planner=ShardLoadPlanner(placement_fn=fn, mesh=mesh))
    for name in EXPERTS:
        assert_tensor_equal(state[name], expected[name], f"rank {rank} {name}")
    return out


@pytest.mark.mp
def test_each_ep_rank_reloads_its_own_experts_over_a_singleton_fsdp_mesh(tmp_path):
    results = run_job(a1_job, 2, str(tmp_path))
    # Stock DCP: every key is wrong on exactly one rank (the rank whose copy was dropped).
    wrong = [set(r["stock_wrong"]) for r in results]
    assert wrong[0] and wrong[1] and not wrong[0] & wrong[1] and wrong[0] | wrong[1] == set(EXPERTS), wrong
    refused = results[0]["refused"]
    assert isinstance(refused, ReplicaMismatchError), refused
    assert all(name in str(refused) for name in EXPERTS) and "ranks [0] vs ranks [1]" in str(refused), refused
    half = str(results[0]["half"])
    assert EXPERTS[2] in half and EXPERTS[3] in half and EXPERTS[0] not in half, half
    assert "edp=0, ep=1" in half and "DeviceMesh(edp:1, ep:2" in half, half
    got = chunks(str(tmp_path / "ours"), EXPERTS)
    for name in EXPERTS:
        assert got[name] == ((8, 3), [((0, 0), (4, 3)), ((4, 0), (4, 3))]), (name, got[name])


# -- EP=2 x EDP=2: round trip, then resharded loads ---------------------------------------


def a2_mesh() -> DeviceMesh:
    # rank = 2 * edp + ep: FSDP (EDP) groups [0, 2] and [1, 3], EP groups [0, 1] and [2, 3].
    return init_device_mesh("cpu", (1, 2, 2, 1), mesh_dim_names=("pp", "edp", "ep", "etp"))


def a2_state(mesh: DeviceMesh) -> dict[str, DTensor]:
    """FSDP2-style parameters: the EP-local block, chunked over EDP like fully_shard does."""
    ep = mesh.get_local_rank("ep")
    state = {}
    for name, rows in EP_LOCAL_ROWS.items():
        block = natural(name, 2 * rows)[ep * rows : (ep + 1) * rows]
        state[name] = distribute_tensor(block, mesh["edp"], [Shard(0)], src_data_rank=None)
    return state


def a2_job(rank: int, world: int, path: str) -> tuple[int, ...]:
    mesh = a2_mesh()
    fn = by_ep(mesh, ("ep", "etp"))
    state = a2_state(mesh)
    expected = {n: p.to_local().clone() for n, p in state.items()}
    wrapped = with_checkpoint_placements(state[EVEN], mesh, fn(EVEN, state[EVEN]), name=EVEN)
    assert wrapped.to_local().data_ptr() == state[EVEN].to_local().data_ptr()  # shares storage
    assert wrapped.shape == (16, 3) and wrapped.stride() == (3, 1), (wrapped.shape, wrapped.stride())
    dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner(placement_fn=fn, mesh=mesh))
    garbage_fill(state)
    dcp.load(state, storage_reader=ShardReader(path), planner=ShardLoadPlanner(placement_fn=fn, mesh=mesh))
    for name in state:
        assert_tensor_equal(state[name], expected[name], f"rank {rank} {name}")
    return tuple(wrapped.__create_chunk_list__()[0].offsets)


def ep2_load_job(rank: int, world: int, path: str) -> None:
    """The resharded load at 2 processes: EP=2, no FSDP; EP rank e gets the natural rows of expert block e."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    state = {n: garbage_like(torch.empty(rows, 3)) for n, rows in EP_LOCAL_ROWS.items()}
    dcp.load(state, storage_reader=ShardReader(path), planner=ShardLoadPlanner(placement_fn=by_ep(mesh), mesh=mesh))
    for name, rows in EP_LOCAL_ROWS.items():
        assert_tensor_equal(state[name], natural(name, 2 * rows)[rank * rows : (rank + 1) * rows], f"rank {rank} {name}")


@pytest.mark.mp
def test_ep2_edp2_round_trips_and_reshards_to_ep2_and_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    offsets = run_job(a2_job, 4, path)
    # Natural order: rank 2 * edp + ep holds rows 8 * ep + 4 * edp (FSDP innermost), not EDP-major.
    assert offsets == [(0, 0), (8, 0), (4, 0), (12, 0)], offsets
    assert chunks(path, [EVEN, UNEVEN]) == {
        EVEN: ((16, 3), [((0, 0), (4, 3)), ((4, 0), (4, 3)), ((8, 0), (4, 3)), ((12, 0), (4, 3))]),
        UNEVEN: ((10, 3), [((0, 0), (3, 3)), ((3, 0), (2, 3)), ((5, 0), (3, 3)), ((8, 0), (2, 3))]),
    }
    run_job(ep2_load_job, 2, path)
    # One process, plain tensors, no planner options: the natural global tensors.
    state = {n: garbage_like(torch.empty(2 * rows, 3)) for n, rows in EP_LOCAL_ROWS.items()}
    dcp.load(state, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
    for name, rows in EP_LOCAL_ROWS.items():
        assert_tensor_equal(state[name], natural(name, 2 * rows), name)


# --------------------------------------------------------------------------- errors


def mesh_error_job(rank: int, world: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    placements = [Replicate(), Shard(0)]
    block = natural(EVEN, 16)[8 * mesh.get_local_rank("ep") :][:8]
    errors = {}
    # FSDP over all 4 ranks: no checkpoint axis spans them.
    flat = distribute_tensor(block, init_device_mesh("cpu", (4,)), [Shard(0)], src_data_rank=None)
    with pytest.raises(ValueError) as unmatched:
        with_checkpoint_placements(flat, mesh, placements, name=EVEN)
    errors["unmatched"] = str(unmatched.value)
    # The same through the planner inside dcp.save: the save fails, nothing silently replicated.
    try:
        dcp.save({EVEN: flat}, storage_writer=ShardWriter(path), planner=ShardSavePlanner(placement_fn=by_ep(mesh), mesh=mesh))
    except CheckpointException as exc:
        errors["planner"] = str(failure(exc))
    # FSDP over the EP ranks, which the checkpoint placements already shard.
    on_ep = distribute_tensor(block, mesh["ep"], [Shard(0)], src_data_rank=None)
    with pytest.raises(ValueError) as conflict:
        with_checkpoint_placements(on_ep, mesh, placements, name=EVEN)
    errors["conflict"] = str(conflict.value)
    # A tensor dim the tensor does not have (was a bare IndexError naming nothing).
    for tensor in (block, block[0, 0]):
        with pytest.raises(ValueError) as no_dim:
            with_checkpoint_placements(tensor, mesh, [Replicate(), Shard(tensor.ndim)], name=EVEN)
        errors[f"dim {tensor.ndim}"] = str(no_dim.value)
    # what placement_fn returns, checked by name (a bare Shard(0) was "'Shard' object is not iterable")
    for label, placements in (("bare", Shard(0)), ("number", 5), ("count", [Shard(0)]), ("kind", [Replicate(), "Shard(0)"])):
        with pytest.raises(ValueError) as wrong:
            with_checkpoint_placements(block, mesh, placements, name=EVEN)
        errors[label] = str(wrong.value)
    with pytest.raises(ValueError) as not_a_mesh:
        with_checkpoint_placements(block, "mesh", placements, name=EVEN)
    errors["mesh"] = str(not_a_mesh.value)
    return errors


@pytest.mark.mp
def test_fsdp_mesh_matching_no_checkpoint_axis_raises(tmp_path):
    results = run_job(mesh_error_job, 4, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / ".metadata").exists()
    for rank, errors in enumerate(results):
        assert EVEN in errors["unmatched"] and "ranks [0, 1, 2, 3]" in errors["unmatched"], errors["unmatched"]
        assert "no axis of the checkpoint mesh DeviceMesh(edp:2, ep:2" in errors["unmatched"], errors["unmatched"]
        assert f"{EVEN}: the parameter is sharded over ranks [0, 1, 2, 3]" in errors["planner"], errors["planner"]
        assert "also shard" in errors["conflict"] and "axis ep" in errors["conflict"], errors["conflict"]
        assert errors["dim 2"] == f"{EVEN}: checkpoint placements [Shard(dim=2)] shard a dim the 2-D tensor does not have"
        assert errors["dim 0"] == f"{EVEN}: checkpoint placements [Shard(dim=0)] shard a dim the 0-D tensor does not have"
        for label, shown in (("bare", "Shard(dim=0)"), ("number", "5")):
            assert errors[label] == (f"{EVEN}: checkpoint placements must be a list with one placement per mesh dim (or "
                                     f"None from placement_fn: leave the key alone), got {shown}"), errors[label]
        assert errors["count"].startswith(f"{EVEN}: 1 checkpoint placements for the 2-D mesh"), errors["count"]
        assert errors["kind"] == f"{EVEN}: checkpoint placements must be Shard or Replicate, got ['Shard(0)']", errors["kind"]
        assert errors["mesh"] == f"{EVEN}: the checkpoint mesh must be a DeviceMesh, got str", errors["mesh"]
    assert "edp=[1, 3], ep=[2, 3]" in results[3]["unmatched"], results[3]["unmatched"]


# -- all-Replicate checkpoint placements -------------------------------------------------

DENSE = {"dense.weight": (3, 4), "dense.bias_row": (1, 4)}  # 2/1 and 1/0 rows over 2 ranks


def a4_job(rank: int, world: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "ep"))
    # Checkpoint placements that shard nothing: all Replicate, and Shard on the size-1 axis.
    placements = {"dense.weight": [Replicate(), Replicate()], "dense.bias_row": [Replicate(), Shard(0)]}
    fn = lambda fqn, t: placements[fqn]  # noqa: E731
    state = {
        n: distribute_tensor(natural(n, *shape), mesh["dp"], [Shard(0)], src_data_rank=None) for n, shape in DENSE.items()
    }
    for name, param in state.items():
        assert with_checkpoint_placements(param, mesh, placements[name], name=name) is param  # kept, no gather
    expected = {n: p.to_local().clone() for n, p in state.items()}
    dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner(placement_fn=fn, mesh=mesh))
    garbage_fill(state)
    dcp.load(state, storage_reader=ShardReader(path), planner=ShardLoadPlanner(placement_fn=fn, mesh=mesh))
    for name in state:
        assert_tensor_equal(state[name], expected[name], f"rank {rank} {name}")
    return {n: tuple(p.to_local().shape) for n, p in state.items()}


@pytest.mark.mp
def test_all_replicate_checkpoint_placements_keep_the_fsdp_chunks(tmp_path):
    path = str(tmp_path / "ckpt")
    shapes = run_job(a4_job, 2, path)
    assert shapes == [{"dense.weight": (2, 4), "dense.bias_row": (1, 4)}, {"dense.weight": (1, 4), "dense.bias_row": (0, 4)}]
    got = chunks(path, DENSE)
    assert got["dense.weight"] == ((3, 4), [((0, 0), (2, 4)), ((2, 0), (1, 4))]), got
    assert got["dense.bias_row"][0] == (1, 4) and ((0, 0), (1, 4)) in got["dense.bias_row"][1], got


# --------------------------------------------------------------------------- replica check (no processes)


def test_a_process_saving_alone_computes_no_chunk_digests(tmp_path):
    """No other rank can declare its chunks: the digests (19 ms of planning for 1,180
    chunks) would be compared with nothing. The save still round-trips bit-exact."""
    state = {f"w{i}": torch.randn(8, 4) + i for i in range(5)}
    planner = ShardSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    assert planner.create_local_plan().chunk_digests is None
    dcp.save(state, storage_writer=ShardWriter(tmp_path), planner=ShardSavePlanner(), no_dist=True)
    got = {k: garbage_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    for key, want in state.items():
        assert_tensor_equal(got[key], want, key)


def test_replica_check_compares_digests_per_chunk():
    whole, top = shard_item("w", (0, 0), (4, 3), (4, 3)), shard_item("w", (0, 0), (2, 3), (4, 3))
    plans = [SavePlan([whole, top]), SavePlan([whole]), SavePlan([whole, top])]
    # same offsets, other size ("top"): a layout question (refined), not this check's
    digests = [digest_rows(b"a", b"x"), digest_rows(b"a"), digest_rows(b"b", b"y")]
    with pytest.raises(ReplicaMismatchError, match=r"'w' chunk at offsets \[0, 0\] size \[4, 3\]: ranks \[0, 1\] vs ranks \[2\]"):
        global_plan(plans, chunk_digests=digests)
    same = global_plan([SavePlan([whole]), SavePlan([whole])], chunk_digests=[digest_rows(b"a"), digest_rows(b"a")])
    assert sorted(len(a.rows) for a in same.assignments) == [0, 1]  # written once


def test_replica_check_across_distinct_tables_leaves_out_ranks_without_a_digest():
    whole = shard_item("w", (0, 0), (4, 3), (4, 3))
    plans = [SavePlan([whole]), SavePlan([whole, shard_item("u", (0,), (2,), (4,))]), SavePlan([whole, shard_item("u", (2,), (2,), (4,))])]
    # three distinct tables share 'w'; rank 1 sent no digest for it
    ok = global_plan(plans, chunk_digests=[digest_rows(b"a"), digest_rows(None, b"u0"), digest_rows(b"a", b"u1")])
    assert sum(len(a.rows) for a in ok.assignments) == 3  # 'w' once, 'u' twice
    with pytest.raises(ReplicaMismatchError, match=r"'w' chunk at offsets \[0, 0\] size \[4, 3\]: ranks \[0\] vs ranks \[2\]"):
        global_plan(plans, chunk_digests=[digest_rows(b"a"), digest_rows(None, b"u0"), digest_rows(b"b", b"u1")])
