"""Shared fixtures: small deterministic state dicts and checkpoint helpers."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlan

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter, clear_metadata_cache

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def sample_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 48, generator=g),
        "b": torch.randn(48, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1000, (33,), generator=g),
        "nested": {"h": torch.randn(16, 8, generator=g).half(), "step": seed},
        "name": f"ckpt-{seed}",
    }


def zeros_like_state(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = zeros_like_state(value)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = type(value)()
    return out


def assert_state_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, dict):
            assert_state_equal(got[key], value)
        elif isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def save(state: dict, path, **writer_kwargs) -> None:
    dcp.save(state, storage_writer=ShardWriter(path, **writer_kwargs), planner=ShardSavePlanner())


def load(like: dict, path, planner: LoadPlanner | None = None, **reader_kwargs) -> tuple[dict, ShardReader]:
    """Load into zeros like ``like`` through ShardReader (and ShardLoadPlanner unless given)."""
    out = zeros_like_state(like)
    reader = ShardReader(path, **reader_kwargs)
    dcp.load(out, storage_reader=reader, planner=planner or ShardLoadPlanner())
    return out, reader


def load_error(like: dict, path, planner: LoadPlanner | None = None, **reader_kwargs) -> BaseException:
    """Load expecting failure; return the exception the rank raised inside DCP.

    DCP wraps a rank's exception in CheckpointException (a BaseException) together with
    its traceback; tests assert on the original.
    """
    try:
        load(like, path, planner, **reader_kwargs)
    except CheckpointException as exc:
        return next(iter(exc.failures.values()))[0]
    raise AssertionError(f"loading {path} unexpectedly succeeded")


def local_save_plans(state: dict) -> list[SavePlan]:
    """The SavePlan a rank of a one-rank job makes for ``state``: real DCP objects, the kind
    megatron-core stores inside ``.metadata``."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    return [planner.create_local_plan()]


@pytest.fixture(autouse=True)
def _fresh_metadata_cache():
    clear_metadata_cache()
    yield
    clear_metadata_cache()
