"""ShardSavePlanner/ShardLoadPlanner set up from a state dict's flat view in one walk
(``planning.flat_state``): what they set is exactly what DCP's default planners set, and
whatever the view does not serve goes DCP's way, with DCP's result or error."""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dcp_ext import ShardLoadPlanner, ShardSavePlanner
from dcp_ext.planning.flat_state import flat_view

from mp import run_job

PAIRS = [(ShardSavePlanner, DefaultSavePlanner), (ShardLoadPlanner, DefaultLoadPlanner)]


def _set_up(planner, state_dict):
    if isinstance(planner, DefaultSavePlanner):
        planner.set_up_planner(state_dict, None, True)
    else:
        planner.set_up_planner(state_dict, "the metadata", True)
    return planner


def _assert_set_up_like_dcp(ours, dcps, state_dict) -> None:
    before = dict(vars(dcps))
    mine, theirs = vars(_set_up(ours, state_dict)), vars(_set_up(dcps, state_dict))
    set_up = [name for name, value in theirs.items() if name not in before or before[name] is not value]
    assert {"state_dict", "is_coordinator"} <= set(set_up)
    for name in set_up:  # every attribute DCP's set-up sets, with its value
        value = theirs[name]
        if name == "state_dict":
            assert list(mine[name]) == list(value)  # same keys, same order
            for key, v in value.items():  # the same tensors (DCP's load set-up copies lists, a list is equal)
                assert mine[name][key] is v if isinstance(v, torch.Tensor) else mine[name][key] == v, key
        elif name == "original_state_dict":
            assert mine[name] is state_dict
        else:
            assert mine[name] == value, name


def _nested_state() -> dict:
    return {
        "model": {"layers": {"0": {"weight": torch.randn(4, 3), "bias": torch.randn(4)}}, "norm.weight": torch.ones(3)},
        "optim": {"state": {}, "lr": 0.5, "step": 7, "flag": True, "name": "adam", "raw": b"\x00", "none": None},
        "buffer": io.BytesIO(b"abc"),
        "top": torch.zeros(2, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize(("ours", "dcps"), PAIRS)
def test_a_nested_state_dict_sets_up_as_dcps_planner_does(ours, dcps):
    state = _nested_state()
    assert flat_view(state) is not None  # the one-walk path is what is compared
    _assert_set_up_like_dcp(ours(), dcps(), state)


def _optimizer_state() -> dict:
    w, b = torch.randn(4, 3), torch.randn(4)
    return {
        "model": {"w": w, "b": b},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, 3)}, "b": {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": ["w", "b"], "nested": [[1, 2], (3,)]}],
        },
        "schedulers": [torch.ones(2), {"last_epoch": 4}, [5, 6]],  # a list DCP walks into, element by element
    }


@pytest.mark.parametrize(("ours", "dcps"), PAIRS)
def test_an_optimizers_lists_set_up_as_dcps_planner_does(ours, dcps):
    state = _optimizer_state()
    view = flat_view(state)
    assert view is not None and "optim.param_groups.0.params" in view[0] and "schedulers.1.last_epoch" in view[0]
    assert view[1]["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")
    _assert_set_up_like_dcp(ours(), dcps(), state)


@pytest.mark.parametrize(("ours", "dcps"), PAIRS)
@pytest.mark.parametrize(
    "state",
    [
        {"model": {0: torch.ones(2)}},  # a key DCP turns into a string
        {"model": {"w": torch.ones(2)}, "pair": (torch.ones(1), 2)},  # a tuple holding a tensor
        {"model": {"w": torch.ones(2)}, "groups": [{}, torch.ones(1)]},  # DCP's rebuild puts None for the {}
        {"model": {"w": torch.ones(2)}, "other": object()},  # an object DCP's load set-up replaces with None
        {"model": {"w": torch.ones(2)}, "z": 1 + 2j, "zs": [1j]},  # complex numbers: the same
        {"model": {"w": torch.ones(2)}, "groups": [(torch.ones(1),), torch.ones(1)]},  # a tuple with a tensor in a list
    ],
    ids=["int-key", "tuple", "empty-dict-in-list", "object", "complex", "tuple-in-list"],
)
def test_what_the_view_does_not_serve_goes_dcps_way(ours, dcps, state):
    assert flat_view(state) is None
    _assert_set_up_like_dcp(ours(), dcps(), state)


@pytest.mark.parametrize(("ours", "dcps"), PAIRS)
def test_a_flattened_key_met_twice_is_dcps_error(ours, dcps):
    state = {"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)}
    assert flat_view(state) is None
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        _set_up(dcps(), state)
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        _set_up(ours(), state)


@pytest.mark.parametrize(("ours", "dcps"), PAIRS)
@pytest.mark.parametrize("option", ["flatten_state_dict", "flatten_sharded_tensors"])
def test_a_flattening_option_turned_off_gets_dcps_set_up(ours, dcps, option):
    state = _nested_state()
    _assert_set_up_like_dcp(ours(**{option: False}), dcps(**{option: False}), state)
    if option == "flatten_state_dict":
        assert list(_set_up(ours(flatten_state_dict=False), state).state_dict) == list(state)  # not flattened


def _dtensors(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    state = {"model": {"w": DTensor.from_local(torch.full((2, 3), float(rank)), mesh, [Shard(0)]), "lr": 0.1}}
    view = flat_view(state)
    assert view is not None and view[0]["model.w"] is state["model"]["w"]
    for ours, dcps in PAIRS:
        _assert_set_up_like_dcp(ours(), dcps(), state)
    meta = {"model": {"w": torch.empty(3, device="meta")}}  # DCP's load set-up allocates it, in place
    assert flat_view(meta) is None
    _set_up(ShardLoadPlanner(), meta)
    assert meta["model"]["w"].device.type == "cpu"


@pytest.mark.mp
def test_dtensors_set_up_as_dcps_planner_does_and_a_meta_tensor_is_allocated():
    run_job(_dtensors, 2)
