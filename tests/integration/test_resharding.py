"""Resharding: a checkpoint saved at one world size loads at another.

Chain 4 -> 2 -> 3 -> 1 processes.  Every stage loads the previous stage's
checkpoint into garbage-filled DTensors with (possibly different) placements,
checks each local shard bit-exact against the slice of the deterministic
global tensor, then saves what it loaded for the next stage.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter

from mp import run_job
from support import assert_state_dict_equal, assert_tensor_equal, garbage_like, make_globals

pytestmark = pytest.mark.mp

WORLDS = (4, 2, 3, 1)

# name -> (global shape, dtype, placement at each stage of WORLDS)
SPECS = {
    "a": ((12, 10), torch.float32, (Shard(0), Shard(1), Shard(0), Replicate())),
    "b": ((7, 5), torch.bfloat16, (Shard(1), Shard(0), Shard(1), Shard(0))),
    "c": ((6, 4), torch.int64, (Replicate(), Shard(0), Replicate(), Shard(1))),
    "d": ((7, 3), torch.float16, (Shard(0), Shard(0), Shard(0), Shard(0))),
    "e": ((1, 4), torch.float32, (Shard(0), Shard(0), Shard(1), Shard(0))),
    "f": ((10,), torch.bool, (Shard(0), Shard(0), Shard(0), Shard(0))),
    "g": ((4, 6, 5), torch.float32, (Shard(2), Shard(1), Shard(0), Replicate())),
}
SEED = 4242


GLOBAL_SPECS = {**SPECS, "plain": ((3, 3), torch.float64)}


def expected_local(glob: torch.Tensor, mesh, placement) -> torch.Tensor:
    return distribute_tensor(glob, mesh, [placement], src_data_rank=None).to_local().clone()


def stage_job(rank: int, world: int, stage: int, load_dir: str | None, save_dir: str | None) -> None:
    mesh = init_device_mesh("cpu", (world,))
    glob = make_globals(GLOBAL_SPECS, SEED)
    if load_dir is None:
        sd = {
            name: distribute_tensor(glob[name].clone(), mesh, [pl[stage]], src_data_rank=None)
            for name, (_, _, pl) in SPECS.items()
        }
        sd["plain"] = glob["plain"].clone()
        sd["meta"] = {"epoch": 3, "saved_at_world": world}
    else:
        sd = {
            name: distribute_tensor(garbage_like(glob[name]), mesh, [pl[stage]], src_data_rank=None)
            for name, (_, _, pl) in SPECS.items()
        }
        sd["plain"] = garbage_like(glob["plain"])
        sd["meta"] = {"epoch": -1, "saved_at_world": -1}
        dcp.load(sd, storage_reader=ShardReader(load_dir), planner=ShardLoadPlanner())
        for name, (_, _, pl) in SPECS.items():
            got = sd[name]
            assert isinstance(got, DTensor) and got.placements == (pl[stage],), f"{name}: {type(got)}"
            assert_tensor_equal(
                got.to_local(),
                expected_local(glob[name], mesh, pl[stage]),
                f"stage {stage} (world {world}) rank {rank} {name} {pl[stage]}",
            )
        assert_tensor_equal(sd["plain"], glob["plain"], f"stage {stage} rank {rank} plain")
        assert sd["meta"] == {"epoch": 3, "saved_at_world": WORLDS[0]}, sd["meta"]
    if save_dir is not None:
        dcp.save(sd, storage_writer=ShardWriter(save_dir), planner=ShardSavePlanner())


@pytest.mark.slow
def test_reshard_chain_4_2_3_1(tmp_path):
    dirs = [str(tmp_path / f"stage{i}_world{w}") for i, w in enumerate(WORLDS)]
    for stage, world in enumerate(WORLDS):
        load_dir = dirs[stage - 1] if stage > 0 else None
        save_dir = dirs[stage] if stage < len(WORLDS) - 1 else None
        run_job(stage_job, world, stage, load_dir, save_dir)


# ---------------------------------------------------------------------------
# Partial reads: a resharded load reads only the bytes it needs.
# ---------------------------------------------------------------------------

PARTIAL_SPECS = {
    "w": ((64, 1024), torch.float32),  # 256 KiB; 128 KiB chunk per saving rank
    "v": ((32, 512), torch.bfloat16),  # 32 KiB
}
# Allowance per (rank, stored record) for headers the reader must parse.
HEADER_ALLOWANCE = 4096


def partial_save_job(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = {n: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for n, t in make_globals(PARTIAL_SPECS, 7).items()}
    dcp.save(sd, storage_writer=ShardWriter(path), planner=ShardSavePlanner())


def partial_load_job(rank: int, world: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    glob = make_globals(PARTIAL_SPECS, 7)
    sd = {n: distribute_tensor(garbage_like(t), mesh, [Shard(0)], src_data_rank=None) for n, t in glob.items()}
    reader = ShardReader(path)
    dcp.load(sd, storage_reader=reader, planner=ShardLoadPlanner())
    expected = {n: expected_local(t, mesh, Shard(0)) for n, t in glob.items()}
    assert_state_dict_equal({n: v.to_local() for n, v in sd.items()}, expected)
    needed = sum(v.to_local().nbytes for v in sd.values())
    return {"bytes_read": reader.stats.bytes_read, "needed": needed, "records": len(sd)}


def test_resharded_load_reads_only_needed_bytes(tmp_path):
    path = str(tmp_path / "ckpt")
    run_job(partial_save_job, 2, path)
    # 2 -> 4 ranks: every rank needs exactly half of one stored chunk per tensor.
    results = run_job(partial_load_job, 4, path)
    needed = sum(r["needed"] for r in results)
    total_global = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in PARTIAL_SPECS.values())
    assert needed == total_global
    read = sum(r["bytes_read"] for r in results)
    allowance = HEADER_ALLOWANCE * sum(r["records"] for r in results)
    limit = 1.05 * needed + allowance
    per_rank = [r["bytes_read"] for r in results]
    assert read <= limit, (
        f"resharded load read {read} bytes over 4 ranks {per_rank}; needed {needed} "
        f"(limit 1.05 x needed + {allowance} header allowance = {limit:.0f}); "
        f"reading whole stored chunks would be {2 * needed}"
    )
    assert read >= needed, f"bytes_read {read} is below the {needed} bytes that were loaded: stats undercount"


class PlanRecordingReader(ShardReader):
    """Records how many read items the coordinator's global step and this rank's read see."""

    gathered_items: int | None = None
    read_items: int = 0

    def prepare_global_plan(self, plans):
        self.gathered_items = sum(len(p.items) for p in plans)
        return super().prepare_global_plan(plans)

    def read_data(self, plan, planner):
        self.read_items = len(plan.items)
        return super().read_data(plan, planner)


def local_items_job(rank: int, world: int, path: str) -> tuple[int | None, int]:
    mesh = init_device_mesh("cpu", (world,))
    glob = make_globals(GLOBAL_SPECS, SEED)
    placements = {name: pl[0] for name, (_, _, pl) in SPECS.items()}
    sd = {name: distribute_tensor(glob[name].clone(), mesh, [placements[name]]) for name in SPECS}
    dcp.save(sd, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    dest = {name: distribute_tensor(garbage_like(glob[name]), mesh, [Shard(0)], src_data_rank=None) for name in SPECS}
    reader = PlanRecordingReader(path)
    dcp.load(dest, storage_reader=reader, planner=ShardLoadPlanner())
    for name in SPECS:
        assert_tensor_equal(dest[name].to_local(), expected_local(glob[name], mesh, Shard(0)), f"rank {rank} {name}")
    return reader.gathered_items, reader.read_items


def test_read_items_stay_on_their_rank(tmp_path):
    """The coordinator's global load step receives no read items; every rank reads its own."""
    results = run_job(local_items_job, 2, str(tmp_path))
    assert results[0][0] == 0 and results[1][0] is None  # only the coordinator runs the global step
    assert all(read >= len(SPECS) for _, read in results), results


# one global shape, three layouts: ShardLoadPlanner works a DTensor's chunk list out once per
# (shape, mesh, placements), so equal shapes with other placements must not share one
SAME_SHAPE = {"rows": Shard(0), "cols": Shard(1), "whole": Replicate()}


def same_shape_job(rank: int, world: int, path: str, load: bool) -> None:
    mesh = init_device_mesh("cpu", (world,))
    glob = make_globals({name: ((6, 4), torch.float32) for name in SAME_SHAPE}, 99)
    source = (lambda t: garbage_like(t)) if load else (lambda t: t.clone())
    placements = SAME_SHAPE if load else {name: Shard(0) for name in SAME_SHAPE}  # saved another way
    sd = {name: distribute_tensor(source(glob[name]), mesh, [placements[name]], src_data_rank=None) for name in SAME_SHAPE}
    if not load:
        dcp.save(sd, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
        return
    dcp.load(sd, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
    for name, placement in SAME_SHAPE.items():
        assert_tensor_equal(sd[name].to_local(), expected_local(glob[name], mesh, placement), f"rank {rank} {name}")


def test_dtensors_of_one_shape_with_other_placements_each_load_their_own_shard(tmp_path):
    path = str(tmp_path / "ckpt")
    run_job(same_shape_job, 3, path, False)
    run_job(same_shape_job, 2, path, True)
