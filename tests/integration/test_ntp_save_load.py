"""Nonuniform tensor parallelism for real: an NTP job saves, and loads at uniform TP and back.

The multi-process layout is 6 gloo ranks: DP replica 0 runs reduced TP2 on its
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
)
from torch.distributed.checkpoint.metadata import (
    TensorStorageMetadata,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.ntp import NonuniformTP, ntp_shard

from mp import run_job
from support import assert_tensor_equal, garbage_like

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


@pytest.mark.mp
def test_ntp_save_has_disjoint_chunks_of_full_volume_where_stock_dcp_fails(ntp_checkpoint):
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


@pytest.mark.mp
def test_ntp_checkpoint_loads_into_uniform_tp4(ntp_checkpoint):
    run_job(load_uniform_job, 4, ntp_checkpoint[0], None)


@pytest.mark.mp
def test_ntp_checkpoint_loads_into_one_process(ntp_checkpoint):
    run_job(load_uniform_job, 1, ntp_checkpoint[0], None)


@pytest.mark.mp
def test_uniform_tp4_checkpoint_loads_into_the_ntp_layout(ntp_checkpoint, tmp_path):
    uniform = str(tmp_path / "tp4")
    run_job(load_uniform_job, 4, ntp_checkpoint[0], uniform)  # re-saved as uniform TP4
    md = ShardReader(uniform).read_metadata().state_dict_metadata
    assert len(md["model.layers.0.attn.qkv.weight"].chunks) == 4
    row_maps = run_job(load_ntp_job, len(COORDS), uniform)
    assert row_maps[4:] == [[(2, 3), (6, 7)], [(3, 4), (7, 8)]]  # the spares


def diverged_replica_job(rank: int, world: int, path: str, diverged: bool) -> str:
    """Rank 0, a reduced replica, holds rows [0, 8) of "w"; rank 1, a core of a healthy
    replica, rows [0, 4). Their chunks differ, so the planner splits them and one writes
    rows [0, 4): before, a diverged copy there was written without a comparison."""
    rows = [(0, 8)] if rank == 0 else [(0, 4)]
    full = torch.arange(16.0).reshape(8, 2)
    local = torch.cat([full[a:b] for a, b in rows]) + (1000.0 if diverged and rank == 1 else 0.0)
    try:
        dcp.save({"w": ntp_shard(local, rows, (8, 2))}, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    except CheckpointException as exc:
        return str(next(iter(exc.failures.values()))[0])
    got = {"w": garbage_like(full)}
    dcp.load(got, storage_reader=FileSystemReader(path), no_dist=True)
    assert_tensor_equal(got["w"], full, "w")
    return "saved"


@pytest.mark.mp
def test_replicas_split_across_different_chunks_are_compared(tmp_path):
    assert run_job(diverged_replica_job, 2, str(tmp_path / "same"), False) == ["saved"] * 2
    messages = run_job(diverged_replica_job, 2, str(tmp_path / "diverged"), True)
    assert all("'w' chunk at offsets [0, 0] size [4, 2]: ranks [0] vs ranks [1]" in m for m in messages), messages
    assert all("ReplicaMismatch" in m or "diverged" in m for m in messages), messages
    assert not (tmp_path / "diverged" / ".metadata").exists()
    assert not list((tmp_path / "diverged").glob("*.distcp"))
