"""Nonuniform tensor parallelism (issue 5): row maps, chunk refinement, save/load (B1-B4).

The multi-process layout (B2, B4) is 6 gloo ranks: DP replica 0 runs reduced TP2 on its
active slots 1 and 3 (slots 0 and 2 failed), DP replica 1 runs TP4 = 2 cores + 2 spares.
Every rank holds its rows of a few parameters and of their Adam state, computed by one
real Adam step on those rows; the expected values are the same step on the global
tensors (Adam is elementwise, so the two agree bit for bit).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.ntp import NonuniformTP, NTPShard, ntp_shard
from mp import assert_tensor_equal, garbage_like, run_job
from planning_util import deduped, global_plan

LAYOUT = NonuniformTP(tp_base=4, tp_spares=2, num_reduced_tp_dp_ranks=1, non_active_ranks_per_dp={0: [0, 2]})
COORDS = [(dp, slot) for dp in range(2) for slot in LAYOUT.active_slots(dp)]  # rank -> (dp, slot)
# name -> (global shape, dtype, partition dim, unit rows)
SPECS = {
    "layers.0.attn.qkv.weight": ((8, 3), torch.float32, 0, 1),
    "layers.0.mlp.fc1.weight": ((24, 16), torch.bfloat16, 0, 3),  # 8 "heads" of 3 rows
    "layers.0.mlp.fc2.weight": ((24, 16), torch.float32, 1, 1),
}
NORM = "layers.0.norm.weight"  # replicated on every rank
STATE_KEYS = ("exp_avg", "exp_avg_sq")
SEED = 505


# -- B1: row maps (pure) ----------------------------------------------------------------


def test_b1_reference_example():
    layout = NonuniformTP(4, 2)
    assert [layout.row_map(1, slot, 8) for slot in range(4)] == [[(0, 2)], [(4, 6)], [(2, 3), (6, 7)], [(3, 4), (7, 8)]]
    assert [layout.row_map(0, slot, 8) for slot in layout.active_slots(0)] == [[(0, 4)], [(4, 8)]]
    assert layout.row_map(1, 2, 24, unit=3) == [(6, 9), (18, 21)]


@pytest.mark.parametrize(
    "tp_base,tp_spares,units,unit",
    [(4, 2, 8, 1), (4, 2, 8, 3), (8, 2, 24, 1), (3, 2, 6, 2), (4, 1, 12, 1), (4, 0, 8, 1), (4, 2, 6, 1)],
)
def test_b1_each_replica_partitions_the_dimension(tp_base, tp_spares, units, unit):
    layout = NonuniformTP(tp_base, tp_spares, num_reduced_tp_dp_ranks=1)
    size = units * unit
    for dp in (0, 1):
        healthy = not layout.is_reduced(dp)
        if healthy and tp_spares and (units % tp_base or units % (tp_base - tp_spares)):
            with pytest.raises(ValueError, match="multiple of tp_base"):
                layout.row_map(dp, 0, size, unit)
            continue
        owned = []
        for slot in layout.active_slots(dp):
            ranges = layout.row_map(dp, slot, size, unit)
            assert ranges == sorted(ranges) and all(a < b and a % unit == 0 and b % unit == 0 for a, b in ranges)
            rows = [r for a, b in ranges for r in range(a, b)]
            if healthy:
                assert len(rows) == size // tp_base  # every healthy rank carries the same share
            owned += rows
        assert sorted(owned) == list(range(size)), (dp, owned)


def test_b1_non_active_ranks_per_dp_honoured():
    layout = NonuniformTP(4, 2, num_reduced_tp_dp_ranks=2, non_active_ranks_per_dp={1: [0, 1]})
    assert layout.active_slots(0) == [0, 1] and layout.active_slots(1) == [2, 3] and layout.active_slots(2) == [0, 1, 2, 3]
    assert layout.row_map(1, 2, 8) == [(0, 4)] and layout.row_map(1, 3, 8) == [(4, 8)]
    assert layout.row_map(2, 3, 8) == [(3, 4), (7, 8)]
    with pytest.raises(ValueError, match="slot 0 of reduced DP replica 1 is not active"):
        layout.row_map(1, 0, 8)


def test_b1_rejects_bad_layouts():
    with pytest.raises(ValueError, match="tp_spares < tp_base"):
        NonuniformTP(4, 4)
    with pytest.raises(ValueError, match="only replicas 0..0 run at reduced TP"):
        NonuniformTP(4, 2, num_reduced_tp_dp_ranks=1, non_active_ranks_per_dp={1: [2, 3]})
    with pytest.raises(ValueError, match="exactly tp_spares=2"):
        NonuniformTP(4, 2, non_active_ranks_per_dp={0: [3]})
    with pytest.raises(ValueError, match="whole number of units"):
        NonuniformTP(4, 2).row_map(1, 0, 8, unit=3)
    with pytest.raises(ValueError, match="no TP slot 4"):
        NonuniformTP(4, 2).row_map(1, 4, 8)


# -- ntp_shard and refinement (pure) ----------------------------------------------------


def test_ntp_shard_views_the_local_tensor():
    local = torch.arange(9.0).reshape(3, 3)  # columns 1 and 5..6 of a (3, 8) tensor
    shard = ntp_shard(local, [(1, 2), (5, 7)], (3, 8), partition_dim=-1)
    assert isinstance(shard, NTPShard) and shard.shape == (3, 8) and shard.dtype == torch.float32
    chunks = shard.__create_chunk_list__()
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((0, 1), (3, 1)), ((0, 5), (3, 2))]
    shard.pieces[1].fill_(-1.0)  # shares storage with what it wraps
    assert torch.equal(local[:, 1:], torch.full((3, 2), -1.0))
    assert torch.equal(local[:, 0], torch.tensor([0.0, 3.0, 6.0]))
    mine = torch.zeros(4, 3)
    wrapped = ntp_shard(mine, [(0, 4)], (8, 3))
    wrapped.__get_tensor_shard__(MetadataIndex("w", [0, 0])).fill_(7.0)
    assert torch.equal(mine, torch.full((4, 3), 7.0))
    with pytest.raises(TypeError, match="runs no tensor ops"):
        torch.add(wrapped, 1)


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(3, 3), [(0, 2)], (8, 3), 0), "does not hold 2 rows"),
        ((torch.zeros(4, 3), [(0, 2), (1, 3)], (8, 3), 0), "disjoint"),
        ((torch.zeros(2, 3), [(7, 9)], (8, 3), 0), "within"),
        (([torch.zeros(2, 3)], [(0, 2), (4, 6)], (8, 3), 0), "1 pieces for 2 ranges"),
        (([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.half)], [(0, 2), (4, 6)], (8, 3), 0), "expected"),
        ((torch.zeros(2, 3), [(0, 2)], (8, 3), 2), "partition_dim 2 out of range"),
    ],
)
def test_ntp_shard_rejects_bad_pieces(args, match):
    with pytest.raises(ValueError, match=match):
        ntp_shard(*args)


def _item(offsets: list[int], sizes: list[int], shape: tuple[int, ...]) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    data = TensorWriteData(chunk, TensorProperties(dtype=torch.float32), torch.Size(shape))
    return WriteItem(index=MetadataIndex("w", chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)


def _ntp_plans() -> list[SavePlan]:
    """Local save plans of the 6 B2 ranks for one (8, 3) tensor "w" plus a replicated one."""
    plans = []
    for dp, slot in COORDS:
        items = [_item([a, 0], [b - a, 3], (8, 3)) for a, b in LAYOUT.row_map(dp, slot, 8)]
        plans.append(SavePlan(items + create_default_local_save_plan({"norm": torch.zeros(5)}, False).items))
    return plans


def _boxes(plans: list[SavePlan], fqn: str) -> list[tuple[int, int]]:
    """(offset, size) along dim 0 of every chunk of ``fqn``."""
    chunks = [i.tensor_data.chunk for p in plans for i in p.items if i.index.fqn == fqn]
    return sorted((c.offsets[0], c.sizes[0]) for c in chunks)


def test_refined_dedup_writes_each_row_once_from_a_holder():
    local = _ntp_plans()
    written = deduped(local)
    assert _boxes(written, "w") == [(0, 2), (2, 1), (3, 1), (4, 2), (6, 1), (7, 1)]
    assert _boxes(written, "norm") == [(0, 5)]
    for rank, plan in enumerate(written):  # a rank writes only rows it holds
        held = {r for a, n in _boxes([local[rank]], "w") for r in range(a, a + n)}
        assert all(set(range(a, a + n)) <= held for a, n in _boxes([plan], "w"))


def test_refinement_leaves_ordinary_plans_alone():
    uniform = [SavePlan([_item([2 * r, 0], [2, 3], (8, 3))]) for r in range(4)]
    plans = uniform + uniform  # a second, identical replica
    assert global_plan(plans).assignments[0].cuts is None
    # an irregular but disjoint tiling stays whole, though a grid would cut the first tile
    tiles = [SavePlan([_item(o, s, (4, 6))]) for o, s in (([0, 0], [4, 3]), ([0, 3], [2, 3]), ([2, 3], [2, 3]))]
    assert global_plan(tiles).assignments[0].cuts is None


# -- multi-process: B2, B3, B4 ------------------------------------------------------------


def _globals() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """Parameters, gradients and the replicated norm weight."""
    g = torch.Generator().manual_seed(SEED)
    params = {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype, _, _) in SPECS.items()}
    grads = {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype, _, _) in SPECS.items()}
    return params, grads, torch.randn(16, generator=g)


def _adam(param: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """One real Adam step: the parameter after it and the optimizer's state."""
    p = torch.nn.Parameter(param.clone())
    p.grad = grad.clone()
    opt = torch.optim.Adam([p], lr=0.01, foreach=False)
    opt.step()
    return {"param": p.detach(), **opt.state[p]}


def _expected() -> dict[str, dict[str, torch.Tensor]]:
    """Global tensors after the step: what every layout must save and load."""
    params, grads, _ = _globals()
    return {n: _adam(params[n], grads[n]) for n in SPECS}


def _garbage(make) -> dict[str, dict[str, torch.Tensor]]:
    """Destinations shaped by ``make(name, global garbage)``; scalars stay plain."""
    return {
        n: {k: make(n, garbage_like(v)) if v.dim() else garbage_like(v) for k, v in t.items()}
        for n, t in _expected().items()
    }


def _state_dict(per_param: dict[str, dict[str, torch.Tensor]], wrap, norm: torch.Tensor, lr: float) -> dict:
    """Model + FQN-keyed Adam state (the shape ``get_optimizer_state_dict`` returns)."""
    return {
        "model": {**{n: wrap(n, t["param"]) for n, t in per_param.items()}, NORM: norm},
        "optim": {
            "state": {n: {"step": t["step"], **{k: wrap(n, t[k]) for k in STATE_KEYS}} for n, t in per_param.items()},
            "param_groups": [{"lr": lr, "params": sorted(per_param)}],
        },
    }


def _check(sd: dict, got: dict[str, dict[str, torch.Tensor]], expect_local, where: str) -> None:
    """``got`` holds the loaded per-parameter tensors; ``expect_local(name, global)`` slices."""
    for name, t in _expected().items():
        for key, full in t.items():
            want = expect_local(name, full) if full.dim() else full
            assert_tensor_equal(got[name][key], want, f"{where} {name} {key}")
    assert_tensor_equal(sd["model"][NORM], _globals()[2], f"{where} {NORM}")
    assert sd["optim"]["param_groups"] == [{"lr": 0.01, "params": sorted(SPECS)}], where


def _ntp_ranges(rank: int, name: str) -> list[tuple[int, int]]:
    dp, slot = COORDS[rank]
    shape, _, dim, unit = SPECS[name]
    return LAYOUT.row_map(dp, slot, shape[dim], unit)


def _ntp_local(rank: int, name: str, full: torch.Tensor) -> torch.Tensor:
    """This NTP rank's rows of a global tensor, back to back (its local parameter)."""
    dim = SPECS[name][2]
    return torch.cat([full.narrow(dim, a, b - a) for a, b in _ntp_ranges(rank, name)], dim)


def _ntp_wrap(rank: int):
    return lambda name, local: ntp_shard(local, _ntp_ranges(rank, name), SPECS[name][0], SPECS[name][2])


def save_ntp_job(rank: int, world: int, path: str, stock_path: str) -> str:
    params, grads, norm = _globals()
    trained = {n: _adam(_ntp_local(rank, n, params[n]), _ntp_local(rank, n, grads[n])) for n in SPECS}
    sd = _state_dict(trained, _ntp_wrap(rank), norm, lr=0.01)
    try:
        dcp.save(sd, storage_writer=ShardWriter(stock_path), planner=DefaultSavePlanner())
        stock_error = ""
    except CheckpointException as exc:
        stock_error = str(next(iter(exc.failures.values()))[0])
    dcp.save(sd, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    return stock_error


def load_uniform_job(rank: int, world: int, path: str, save_path: str | None) -> None:
    """Load into uniform TP: DTensors sharded on the partition dim (plain tensors at 1 proc)."""
    mesh = init_device_mesh("cpu", (world,))

    def shard(name: str, full: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(full, mesh, [Shard(SPECS[name][2])], src_data_rank=None) if world > 1 else full

    def expect_local(name: str, full: torch.Tensor) -> torch.Tensor:
        return shard(name, full).to_local() if world > 1 else full

    readers = [(ShardReader(path), ShardLoadPlanner())]
    if world == 1:  # stock DCP reads the NTP checkpoint too: it is an ordinary one
        readers.append((FileSystemReader(path), DefaultLoadPlanner()))
    for reader, planner in readers:
        got = _garbage(shard)
        sd = _state_dict(got, lambda n, t: t, garbage_like(_globals()[2]), lr=-1.0)
        dcp.load(sd, storage_reader=reader, planner=planner)
        _check(sd, got, expect_local, f"uniform TP{world} rank {rank} {type(reader).__name__}")
    if save_path is not None:
        dcp.save(sd, storage_writer=ShardWriter(save_path), planner=ShardSavePlanner())


def load_ntp_job(rank: int, world: int, path: str) -> list[tuple[int, int]]:
    """Load into the NTP layout; the caller's local tensors are filled in place."""
    got = _garbage(lambda n, g: _ntp_local(rank, n, g))
    sd = _state_dict(got, _ntp_wrap(rank), garbage_like(_globals()[2]), lr=-1.0)
    dcp.load(sd, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
    _check(sd, got, lambda n, full: _ntp_local(rank, n, full), f"NTP rank {rank}")
    return _ntp_ranges(rank, "layers.0.attn.qkv.weight")


@pytest.fixture(scope="module")
def ntp_checkpoint(tmp_path_factory) -> tuple[str, list[str]]:
    root = tmp_path_factory.mktemp("ntp")
    errors = run_job(save_ntp_job, len(COORDS), str(root / "ntp"), str(root / "stock"))
    return str(root / "ntp"), errors


def test_b2_ntp_save_has_disjoint_chunks_of_full_volume(ntp_checkpoint):
    path, stock_errors = ntp_checkpoint
    assert all("overlapping chunks" in e for e in stock_errors), stock_errors  # stock DCP cannot save it
    md = ShardReader(path).read_metadata().state_dict_metadata
    for fqn, tmd in md.items():
        if not isinstance(tmd, TensorStorageMetadata) or not tmd.size:
            continue
        chunks = tmd.chunks
        assert sum(math.prod(c.sizes) for c in chunks) == math.prod(tmd.size), fqn
        for n, a in enumerate(chunks):
            for b in chunks[n + 1 :]:
                assert any(
                    ao + asz <= bo or bo + bsz <= ao for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes)
                ), f"{fqn}: {a} overlaps {b}"
    for fqn in ("model.layers.0.attn.qkv.weight", "optim.state.layers.0.attn.qkv.weight.exp_avg"):
        assert sorted(c.offsets[0] for c in md[fqn].chunks) == [0, 2, 3, 4, 6, 7]  # refined at all boundaries


def test_b3_ntp_checkpoint_loads_into_uniform_tp4(ntp_checkpoint):
    run_job(load_uniform_job, 4, ntp_checkpoint[0], None)


def test_b3_ntp_checkpoint_loads_into_one_process(ntp_checkpoint):
    run_job(load_uniform_job, 1, ntp_checkpoint[0], None)


def test_b4_uniform_tp4_checkpoint_loads_into_ntp(ntp_checkpoint, tmp_path):
    uniform = str(tmp_path / "tp4")
    run_job(load_uniform_job, 4, ntp_checkpoint[0], uniform)  # re-saved as uniform TP4
    md = ShardReader(uniform).read_metadata().state_dict_metadata
    assert len(md["model.layers.0.attn.qkv.weight"].chunks) == 4
    row_maps = run_job(load_ntp_job, len(COORDS), uniform)
    assert row_maps[4:] == [[(2, 3), (6, 7)], [(3, 4), (7, 8)]]  # the spares
