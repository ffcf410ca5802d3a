"""End to end: a small MoE block under EP=2 x FSDP2 (EDP=2), one AdamW step, saved with
checkpoint placements and reloaded into EP=2 x EDP=2 and into a single process.

4 experts, 2 per EP rank, stacked as ``experts.w1`` (local (2, D, H)); FSDP2 shards them
over EDP, so each rank holds one expert. The router is FSDP-sharded over all 4 ranks.
Expected tensors are assembled independently of dcp_ext (all_gather_object of every
rank's local shard, ordered by global expert index ``2 * ep + edp``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter

from mp import run_job
from support import assert_state_dict_equal, assert_tensor_equal

pytestmark = pytest.mark.mp

D, H, EXPERTS, EP = 6, 4, 4, 2
EXPERT_KEYS = ("experts.w1", "experts.w2")


class Experts(nn.Module):
    def __init__(self, n_local: int, generator: torch.Generator) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_local, D, H, generator=generator) * 0.3)
        self.w2 = nn.Parameter(torch.randn(n_local, H, D, generator=generator) * 0.3)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        hidden = torch.einsum("td,edh->teh", x, self.w1).relu()
        return torch.einsum("teh,ehd,te->td", hidden, self.w2, gates)


class MoE(nn.Module):
    """Router over all experts; this rank computes its local experts only (no token exchange:
    the test is about the checkpoint, not about dispatch)."""

    def __init__(self, ep: int, ep_rank: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.n_local, self.first = EXPERTS // ep, ep_rank * (EXPERTS // ep)
        self.experts = Experts(self.n_local, torch.Generator().manual_seed(seed * 100 + ep_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)[:, self.first : self.first + self.n_local]
        return x + self.experts(x, gates)


def parallel_moe(seed: int, lr: float) -> tuple[MoE, torch.optim.Optimizer, DeviceMesh]:
    mesh = init_device_mesh("cpu", (2, EP), mesh_dim_names=("edp", "ep"))  # rank = 2 * edp + ep
    model = MoE(EP, mesh.get_local_rank("ep"), seed)
    fully_shard(model.experts, mesh=mesh["edp"])
    fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
    return model, torch.optim.AdamW(model.parameters(), lr=lr), mesh


def placement_fn(fqn: str, tensor: torch.Tensor):
    return [Replicate(), Shard(0)] if fqn in EXPERT_KEYS else None


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def save_job(rank: int, world: int, path: str) -> dict:
    model, optim, mesh = parallel_moe(seed=1, lr=0.01)
    loss = model(torch.randn(8, D, generator=torch.Generator().manual_seed(7 + rank))).square().mean()
    loss.backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save(
        {"model": msd, "optim": osd},
        storage_writer=ShardWriter(path),
        planner=ShardSavePlanner(placement_fn=placement_fn, mesh=mesh),
    )
    return _natural_state(msd, osd, mesh)


def _natural_state(msd: dict, osd: dict, mesh: DeviceMesh) -> dict:
    """Full natural tensors: experts in global order from every rank's shard, router gathered."""
    mine = (2 * mesh.get_local_rank("ep") + mesh.get_local_rank("edp"), {
        key: (_local(msd[key]).clone(), {k: _local(v).clone() for k, v in osd["state"][key].items() if v.ndim})
        for key in EXPERT_KEYS
    })
    shards: list = [None] * dist.get_world_size()
    dist.all_gather_object(shards, mine)
    shards.sort(key=lambda s: s[0])
    full = {"model": {"router.weight": msd["router.weight"].full_tensor()}, "optim": {}}
    router_state = osd["state"]["router.weight"]
    full["optim"]["router.weight"] = {k: v.full_tensor() if v.ndim else v for k, v in router_state.items()}
    for key in EXPERT_KEYS:
        full["model"][key] = torch.cat([s[1][key][0] for s in shards])
        full["optim"][key] = {k: torch.cat([s[1][key][1][k] for s in shards]) for k in ("exp_avg", "exp_avg_sq")}
        full["optim"][key]["step"] = osd["state"][key]["step"]
    return full


def parallel_load_job(rank: int, world: int, path: str, expected: dict) -> None:
    model, optim, mesh = parallel_moe(seed=2, lr=0.5)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ShardReader(path), planner=ShardLoadPlanner(placement_fn=placement_fn, mesh=mesh))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert optim.param_groups[0]["lr"] == 0.01, optim.param_groups[0]["lr"]  # bytes items reached our dict
    msd, osd = get_state_dict(model, optim)
    expert = 2 * mesh.get_local_rank("ep") + mesh.get_local_rank("edp")
    where = f"rank {rank} (expert {expert})"
    assert_tensor_equal(msd["router.weight"].full_tensor(), expected["model"]["router.weight"], f"{where} router")
    for key in EXPERT_KEYS:
        assert_tensor_equal(msd[key], expected["model"][key][expert : expert + 1], f"{where} {key}")
        for name in ("exp_avg", "exp_avg_sq"):
            want = expected["optim"][key][name][expert : expert + 1]
            assert_tensor_equal(osd["state"][key][name], want, f"{where} {key}.{name}")
        assert_tensor_equal(osd["state"][key]["step"], expected["optim"][key]["step"], f"{where} {key}.step")


def single_load_job(rank: int, world: int, path: str, expected: dict) -> None:
    model = MoE(ep=1, ep_rank=0, seed=3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, optim)
    assert_state_dict_equal(msd, expected["model"], "1 proc model")
    assert_state_dict_equal(osd["state"], expected["optim"], "1 proc optim")


def test_moe_ep2_fsdp2_adamw_roundtrip(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_job(save_job, 4, path)
    expected = saved[0]
    for other in saved[1:]:
        assert_state_dict_equal(other, expected)
    # The step moved every expert and the experts differ from one another.
    w1 = expected["model"]["experts.w1"]
    assert w1.shape == (EXPERTS, D, H) and all(bool((w1[e] != w1[0]).any()) for e in range(1, EXPERTS))
    assert all(bool(expected["optim"][k]["exp_avg"].abs().sum(dim=(1, 2)).gt(0).all()) for k in EXPERT_KEYS)
    run_job(parallel_load_job, 4, path, expected)
    run_job(single_load_job, 1, path, expected)
