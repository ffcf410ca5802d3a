"""FSDP2 model + AdamW state through ShardWriter/ShardReader at a new world size.

A small model is sharded with ``fully_shard`` on a CPU mesh (gloo), trained
for two AdamW steps, and saved with ``get_state_dict`` + ``dcp.save``.  The
full (unsharded) tensors are gathered at save time.  A fresh model/optimizer
at a different world size loads the checkpoint (``dcp.load`` +
``set_state_dict``) and every parameter and optimizer state (exp_avg,
exp_avg_sq, step) must equal the saved full tensors bit-exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter

from mp import run_job
from support import assert_state_dict_equal, assert_tensor_equal

pytestmark = pytest.mark.mp

SAVE_LR = 0.01
WEIGHT_DECAY = 0.05


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Dims 10, 5 and 7 shard unevenly over 2 and 4 ranks (some shards empty).
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 7, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc2(torch.relu(self.fc1(x)))))


def build(world: int, seed: int, lr: float):
    torch.manual_seed(seed)  # identical initial params on every rank
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for sub in (model.fc1, model.fc2, model.head):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    return model, optim


def _full(value):
    """Gather a DTensor to its full tensor (collective); clone plain tensors."""
    if isinstance(value, DTensor):
        return value.full_tensor().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def _full_state(model, optim) -> dict:
    msd, osd = get_state_dict(model, optim)
    return {"model": _full(msd), "optim_state": _full(osd["state"]), "param_groups": osd["param_groups"]}


def save_job(rank: int, world: int, path: str) -> dict:
    model, optim = build(world, seed=0, lr=SAVE_LR)
    g = torch.Generator().manual_seed(100 + rank)  # different data per rank
    for _ in range(2):
        loss = model(torch.randn(8, 6, generator=g)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    # Sanity: FSDP2 really sharded the state we are about to save.
    assert all(isinstance(v, DTensor) for v in msd.values()), {k: type(v) for k, v in msd.items()}
    state = {"model": msd, "optim": osd}
    dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    return _full_state(model, optim)


def load_job(rank: int, world: int, path: str, expected: dict) -> None:
    # Different seed and lr: nothing matches until the checkpoint is loaded.
    model, optim = build(world, seed=1, lr=0.5)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    reader = ShardReader(path)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert reader.stats.items_read > 0 and reader.stats.bytes_read > 0, reader.stats

    got = _full_state(model, optim)
    where = f"world {world} rank {rank}"
    assert_state_dict_equal(got["model"], expected["model"], f"{where} model")
    assert set(got["optim_state"]) == set(expected["optim_state"]), (got["optim_state"].keys(), expected["optim_state"].keys())
    for fqn, st in expected["optim_state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_tensor_equal(got["optim_state"][fqn][key], st[key], f"{where} optim.state[{fqn}].{key}")
        assert float(st["step"]) == 2.0, st["step"]
    for pg_got, pg_exp in zip(got["param_groups"], expected["param_groups"]):
        assert pg_got == pg_exp, f"{where} param_groups {pg_got} != {pg_exp}"
    assert optim.param_groups[0]["lr"] == SAVE_LR, optim.param_groups[0]["lr"]

    # The live parameters (local shards) hold the right slices of the saved
    # full tensors, not just the state dict copies.
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert_tensor_equal(p.full_tensor(), expected["model"][name], f"{where} param {name}")

    # Training continues from the loaded state without error on every rank.
    loss = model(torch.randn(4, 6, generator=torch.Generator().manual_seed(7))).sum()
    loss.backward()
    optim.step()
    dist.barrier()


@pytest.mark.parametrize(
    "save_world,load_world",
    [
        pytest.param(2, 1, id="2to1"),
        pytest.param(4, 2, id="4to2", marks=pytest.mark.slow),
    ],
)
def test_fsdp2_adamw_reshard(tmp_path, save_world, load_world):
    path = str(tmp_path / "ckpt")
    saved = run_job(save_job, save_world, path)
    expected = saved[0]
    # Every saving rank gathered the same full tensors.
    for other in saved[1:]:
        assert_state_dict_equal(other["model"], expected["model"])
    # The optimizer actually moved: exp_avg is not all zero.
    assert any(bool(st["exp_avg"].abs().sum() > 0) for st in expected["optim_state"].values())
    run_job(load_job, load_world, path, expected)


def empty_shard_job(rank: int, world: int, path: str) -> None:
    """``Linear(1, 1)``, row-parallel over tp=2 and fully_shard over dp=2: the weight is
    (Shard(0), Shard(1)) and the tp rank with no column holds a (0, 0) local tensor that
    DTensor describes as a chunk of sizes (1, 0). Resolving that chunk narrowed the
    (0, 0) tensor by one row: every rank failed with a RuntimeError naming nothing."""
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 1))
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    dcp.save(model.state_dict(), storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    dist.barrier()
    if rank == 0:
        got = {k: torch.full_like(v, 777.0) for k, v in want.items()}
        dcp.load(got, storage_reader=ShardReader(path), planner=ShardLoadPlanner(), no_dist=True)
        assert_state_dict_equal(got, want)
        stock = {k: torch.full_like(v, 777.0) for k, v in want.items()}
        dcp.load(stock, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        assert_state_dict_equal(stock, want)
    dist.barrier()


@pytest.mark.mp
def test_a_tp_shard_with_no_columns_saves(tmp_path):
    run_job(empty_shard_job, 4, str(tmp_path / "ckpt"))
