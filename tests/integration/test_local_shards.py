"""A save's local write items with each DTensor layout worked out once (``local_shards``):
the same items as DCP's own local plan, field for field, on a 2 x 2 mesh."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dcp_ext.planning.dedup import chunk_view
from dcp_ext.planning.local_shards import local_write_items

from mp import run_job


def _state(rank: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # every rank distributes the same global tensors
    state: dict[str, object] = {}
    for n in range(3):  # three DTensors of one layout: one memo entry
        state[f"w{n}"] = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0), Shard(1)])
    state["uneven"] = distribute_tensor(torch.randn(7, 5), mesh, [Shard(1), Shard(0)])
    state["replicated"] = distribute_tensor(torch.randn(4), mesh, [Replicate(), Replicate()])
    state["param"] = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0), Replicate()]))
    submesh = DeviceMesh("cpu", [0, 1])  # ranks 2 and 3 are outside it
    state["on_submesh"] = distribute_tensor(torch.randn(4, 4), submesh, [Shard(0)])
    state.update(_plain_tensors(rank))
    state["step"] = {"lr": 0.1}
    return state


def _plain_tensors(rank: int) -> dict[str, torch.Tensor]:
    """Plain tensors of every kind a state dict holds (their items are built without DCP's constructors)."""
    return {
        "plain": torch.full((3,), float(rank)),
        "needs_grad": torch.randn(2, 3, requires_grad=True),
        "scalar": torch.tensor(7.0),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(3, 5).t(),
        "bf16": torch.randn(4, 2).to(torch.bfloat16),
        "plain_param": torch.nn.Parameter(torch.randn(2)),  # a subclass: DCP's own path
    }


def test_plain_tensor_items_are_dcps_field_for_field():
    """Without a process group: a plain tensor's item (offsets a ``torch.Size`` of zeros,
    its properties, with and without grad mode) equals DCP's own."""
    state = _plain_tensors(0)
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with mode():
            ours = local_write_items(state, {})
            stock = create_default_local_save_plan(state, True).items
            assert ours == stock, (ours, stock)
            assert all(type(a.index.offset) is torch.Size and a.index.offset == b.index.offset for a, b in zip(ours, stock))


def _compare_with_dcp(rank: int, world: int) -> int:
    state = _state(rank)
    memo: dict = {}
    ours = local_write_items(state, memo)
    stock = create_default_local_save_plan(state, rank == 0).items
    assert ours == stock, (ours, stock)
    with torch.no_grad():  # to_local() returns the local tensor itself there: its requires_grad is recorded
        assert local_write_items(state, {}) == create_default_local_save_plan(state, rank == 0).items
    with torch.inference_mode():
        assert local_write_items(state, {}) == create_default_local_save_plan(state, rank == 0).items
    assert len(memo) == (5 if rank < 2 else 4)  # w0-w2 share one; on_submesh only where the rank is in it
    for item in ours:  # the data each item saves: a DTensor's local values
        obj = state[item.index.fqn]
        if isinstance(obj, DTensor):
            assert torch.equal(chunk_view(obj, item, memo), obj.to_local())
    partial = DTensor.from_local(torch.ones(2), state["w0"].device_mesh, [Partial(), Replicate()])
    for make in (lambda: local_write_items({"p": partial}, {}), lambda: create_default_local_save_plan({"p": partial}, True)):
        with pytest.raises(Exception) as raised:
            make()
        assert "Partial" in str(raised.value) or "partial" in str(raised.value)
    return len(ours)


@pytest.mark.mp
def test_local_write_items_are_dcps_with_each_dtensor_layout_worked_out_once():
    counts = run_job(_compare_with_dcp, 4)
    assert counts == [15, 15, 14, 14]  # ranks 2 and 3 hold no shard of the submesh tensor
