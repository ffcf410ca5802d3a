"""DCP's load-planner hooks keep working on ShardLoadPlanner subclasses.

``ShardLoadPlanner.resolve_tensor`` hands a whole plain tensor or DTensor shard over
without DCP's narrow (a view per dimension); that shortcut stands only while
``transform_tensor`` is DCP's own: a subclass's override, or one set on the instance, is
called for every tensor item, and where it sends the bytes is where they land.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from dcp_ext import ShardLoadPlanner, ShardReader, ShardWriter

from support import assert_tensor_equal, garbage_like


def _saved(tmp_path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}
    dcp.save(state, storage_writer=ShardWriter(tmp_path), no_dist=True)
    return state


class Staging(ShardLoadPlanner):
    """Reads every tensor into a scratch buffer of its own and commits twice its values."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch: dict[str, torch.Tensor] = {}

    def transform_tensor(self, read_item, tensor):  # noqa: ANN001, ANN201
        buffer = torch.empty_like(super().transform_tensor(read_item, tensor))
        self.scratch[read_item.dest_index.fqn] = buffer
        return buffer

    def commit_tensor(self, read_item, tensor):  # noqa: ANN001, ANN201
        fqn = read_item.dest_index.fqn
        assert tensor.data_ptr() == self.scratch[fqn].data_ptr()  # the buffer (the reader holds it detached)
        self.state_dict[fqn].copy_(tensor * 2)


def test_an_overridden_transform_tensor_decides_where_every_item_lands(tmp_path):
    saved = _saved(tmp_path)
    got = {k: garbage_like(v) for k, v in saved.items()}
    planner = Staging()
    dcp.load(got, storage_reader=ShardReader(tmp_path), planner=planner, no_dist=True)
    assert sorted(planner.scratch) == ["a", "b"]
    for key, want in saved.items():
        assert_tensor_equal(planner.scratch[key], want, key)
        assert_tensor_equal(got[key], want * 2, key)


def test_whole_tensors_land_in_place_under_dcps_own_transform(tmp_path):
    saved = _saved(tmp_path)
    got = {k: garbage_like(v) for k, v in saved.items()}
    storages = {k: v.untyped_storage().data_ptr() for k, v in got.items()}
    dcp.load(got, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    for key, want in saved.items():
        assert got[key].untyped_storage().data_ptr() == storages[key], key
        assert_tensor_equal(got[key], want, key)


def test_a_transform_tensor_set_on_the_instance_is_called_for_every_item(tmp_path):
    saved = _saved(tmp_path)
    got = {k: garbage_like(v) for k, v in saved.items()}
    before = {k: v.clone() for k, v in got.items()}
    planner = ShardLoadPlanner()
    seen: dict[str, torch.Tensor] = {}
    planner.transform_tensor = lambda read_item, tensor: seen.setdefault(read_item.dest_index.fqn, torch.empty_like(tensor))
    dcp.load(got, storage_reader=ShardReader(tmp_path), planner=planner, no_dist=True)
    assert sorted(seen) == ["a", "b"]
    for key, want in saved.items():
        assert_tensor_equal(seen[key], want, key)
        assert_tensor_equal(got[key], before[key], key)  # the bytes went where the override said


class Redirects:
    """DCP's ``lookup_tensor`` extension point: every tensor loads into a buffer of the planner's own."""

    def set_up_planner(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        super().set_up_planner(*args, **kwargs)
        self.buffers = {key: torch.full_like(value, -2.0) for key, value in self.state_dict.items()}

    def lookup_tensor(self, index):  # noqa: ANN001, ANN201
        return self.buffers[index.fqn]


class ShardRedirects(Redirects, ShardLoadPlanner):
    pass


class StockRedirects(Redirects, DefaultLoadPlanner):
    pass


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_an_overridden_lookup_tensor_decides_where_every_tensor_lands(tmp_path, writer):
    """As with DCP's planner and reader: the bytes land in what ``lookup_tensor`` returns,
    and the state dict's tensors keep their values. ShardLoadPlanner found a destination
    itself and skipped the override: the state dict was overwritten, the buffers left as
    they were."""
    saved = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    dcp.save(saved, storage_writer=ShardWriter(tmp_path) if writer == "ours" else dcp.FileSystemWriter(tmp_path), no_dist=True)
    for planner, reader in ((ShardRedirects(), ShardReader(tmp_path)), (StockRedirects(), dcp.FileSystemReader(tmp_path))):
        got = {k: garbage_like(v) for k, v in saved.items()}
        before = {k: v.clone() for k, v in got.items()}
        dcp.load(got, storage_reader=reader, planner=planner, no_dist=True)
        for key, want in saved.items():
            assert_tensor_equal(planner.buffers[key], want, f"{type(planner).__name__} {key}")
            assert_tensor_equal(got[key], before[key], f"{type(planner).__name__} {key}")
    planner = ShardLoadPlanner()  # set on the instance, after set_up_planner made the state dict
    got = {k: garbage_like(v) for k, v in saved.items()}
    buffers = {k: torch.full_like(v, -2.0) for k, v in saved.items()}
    planner.lookup_tensor = lambda index: buffers[index.fqn]
    dcp.load(got, storage_reader=ShardReader(tmp_path), planner=planner, no_dist=True)
    assert all(torch.equal(buffers[k], v) for k, v in saved.items())


class KeepsNewRows(ShardLoadPlanner):
    """DCP's usual extension point: a create_local_plan that reads less on purpose."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[i for i in plan.items if i.dest_index.fqn != "keep"])


@pytest.mark.parametrize("reader", ["ours", "stock"])
def test_a_subclass_create_local_plan_decides_what_is_read(tmp_path, reader):
    """The planner sent up an empty plan and put its own items back in finish_plan, so a
    subclass saw no items and its filtering was thrown away: "keep" was overwritten."""
    dcp.save({"keep": torch.zeros(4), "other": torch.arange(4.0)}, storage_writer=ShardWriter(tmp_path), no_dist=True)
    state = {"keep": torch.full((4,), 7.0), "other": garbage_like(torch.arange(4.0))}
    storage = ShardReader(tmp_path) if reader == "ours" else dcp.FileSystemReader(tmp_path)
    dcp.load(state, storage_reader=storage, planner=KeepsNewRows(), no_dist=True)
    assert_tensor_equal(state["keep"], torch.full((4,), 7.0), "keep")
    assert_tensor_equal(state["other"], torch.arange(4.0), "other")


def test_a_save_planner_subclass_that_changes_its_local_items_is_refused(tmp_path):
    """Its items were thrown away: a key it dropped was saved (the plan travels as a table of
    the whole state dict). A subclass that changes the items is refused before anything is
    written; one that only wraps create_local_plan saves as before."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_ext import InvalidRequestError, ShardSavePlanner

    class DropsSecret(ShardSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            return dataclasses.replace(plan, items=[i for i in plan.items if i.index.fqn != "secret"])

    class Logs(ShardSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            self.logged = len(plan.items)
            return plan

    state = {"secret": torch.ones(2), "w": torch.arange(3.0)}
    with pytest.raises(CheckpointException) as info:
        dcp.save(state, storage_writer=ShardWriter(tmp_path / "dropped"), planner=DropsSecret(), no_dist=True)
    error = next(iter(info.value.failures.values()))[0]
    assert isinstance(error, InvalidRequestError) and "rank 0's local plan came back with items of its own" in str(error)
    assert not (tmp_path / "dropped" / ".metadata").exists()
    planner = Logs()
    dcp.save(state, storage_writer=ShardWriter(tmp_path / "logged"), planner=planner, no_dist=True)
    out = {k: garbage_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=ShardReader(tmp_path / "logged"), no_dist=True)
    assert planner.logged == 0 and all(torch.equal(out[k], v) for k, v in state.items())


class Counted:
    """An allowlisted class that counts how often a load builds it."""

    built = 0

    def __init__(self, n: int):
        self.n = n
        Counted.built += 1

    def __reduce__(self):  # noqa: ANN204
        return Counted, (self.n,)


class Doubling(ShardLoadPlanner):
    """Rewrites a bytes item before ShardLoadPlanner decodes it."""

    def load_bytes(self, read_item, value):  # noqa: ANN001, ANN201
        obj = torch.load(value, weights_only=False)
        rewritten = io.BytesIO()
        torch.save(Counted(obj.n * 2), rewritten)
        value.seek(0)
        value.truncate()
        value.write(rewritten.getvalue())
        value.seek(0)
        super().load_bytes(read_item, value)


@pytest.mark.parametrize(
    ("planner", "built", "n"),
    [(ShardLoadPlanner, 1, 7), (Doubling, 4, 14)],
    ids=["ShardLoadPlanner", "subclass rewriting the bytes"],
)
def test_a_bytes_item_is_unpickled_once_per_load(tmp_path, planner, built, n):
    """ShardReader checks every bytes item with the restricted loader before a planner sees
    it; ShardLoadPlanner, which would decode with the same loader, takes that object (a
    large item, a sampler's indices, took seconds twice). A subclass that rewrote the bytes
    gets them decoded anew: reader's check, its own torch.load, its re-save, the decode."""
    dcp.save({"sampler": Counted(7)}, storage_writer=ShardWriter(tmp_path), no_dist=True)
    state = {"sampler": None}
    with torch.serialization.safe_globals([Counted]):
        Counted.built = 0
        dcp.load(state, storage_reader=ShardReader(tmp_path), planner=planner(), no_dist=True)
    assert Counted.built == built
    assert type(state["sampler"]) is Counted and state["sampler"].n == n
