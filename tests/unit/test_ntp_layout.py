"""Nonuniform tensor parallelism without processes: row maps, NTP shards, chunk refinement.

A reduced DP replica runs TP at a lower degree; a healthy one has core ranks plus spares
that own rows round-robin from the ends of the core partitions. The save planner cuts
every chunk at the union of all layouts' boundaries so identical pieces dedup.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

from dcp_ext.ntp import NonuniformTP, NTPShard, ntp_shard

from support import deduped, global_plan, shard_item

LAYOUT = NonuniformTP(tp_base=4, tp_spares=2, num_reduced_tp_dp_ranks=1, non_active_ranks_per_dp={0: [0, 2]})
COORDS = [(dp, slot) for dp in range(2) for slot in LAYOUT.active_slots(dp)]  # rank -> (dp, slot)


# -- row maps ---------------------------------------------------------------------------
def test_row_maps_match_the_reference_example():
    layout = NonuniformTP(4, 2)
    assert [layout.row_map(1, slot, 8) for slot in range(4)] == [[(0, 2)], [(4, 6)], [(2, 3), (6, 7)], [(3, 4), (7, 8)]]
    assert [layout.row_map(0, slot, 8) for slot in layout.active_slots(0)] == [[(0, 4)], [(4, 8)]]
    assert layout.row_map(1, 2, 24, unit=3) == [(6, 9), (18, 21)]


@pytest.mark.parametrize(
    "tp_base,tp_spares,units,unit",
    [(4, 2, 8, 1), (4, 2, 8, 3), (8, 2, 24, 1), (3, 2, 6, 2), (4, 1, 12, 1), (4, 0, 8, 1), (4, 2, 6, 1)],
)
def test_each_replica_partitions_the_dimension(tp_base, tp_spares, units, unit):
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


def test_failed_slots_of_a_reduced_replica_own_no_rows():
    layout = NonuniformTP(4, 2, num_reduced_tp_dp_ranks=2, non_active_ranks_per_dp={1: [0, 1]})
    assert layout.active_slots(0) == [0, 1] and layout.active_slots(1) == [2, 3] and layout.active_slots(2) == [0, 1, 2, 3]
    assert layout.row_map(1, 2, 8) == [(0, 4)] and layout.row_map(1, 3, 8) == [(4, 8)]
    assert layout.row_map(2, 3, 8) == [(3, 4), (7, 8)]
    with pytest.raises(ValueError, match="slot 0 of reduced DP replica 1 is not active"):
        layout.row_map(1, 0, 8)


def test_bad_layouts_are_rejected():
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
    for bad in ("4", 4.5):  # was a bare TypeError, or accepted
        with pytest.raises(ValueError, match=r"NonuniformTP\(tp_base=\.\.\.\) must be an integer"):
            NonuniformTP(bad, 2)


def test_a_rank_that_owns_no_rows_wraps_its_empty_tensor():
    """``row_map`` gives [] for a slot with no rows (8 rows cannot reach every slot of a
    size-1 tensor); the documented flow passed that on and was refused."""
    rows = NonuniformTP(tp_base=4, tp_spares=2).row_map(0, 1, size=1)
    assert rows == []
    shard = ntp_shard(torch.empty(0, 3), rows, global_shape=(1, 3))
    assert shard.shape == (1, 3) and shard.dtype == torch.float32


# -- ntp_shard and refinement ---------------------------------------------------------------
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
        ((torch.zeros(2, 3), [(0.5, 2.5)], (8, 3), 0), "integer pairs"),  # was cut to [0, 2) silently
    ],
)
def test_ntp_shard_rejects_bad_pieces(args, match):
    with pytest.raises(ValueError, match=match):
        ntp_shard(*args)


def _ntp_plans() -> list[SavePlan]:
    """Local save plans of the 6 ranks of ``LAYOUT`` for one (8, 3) tensor "w" plus a replicated one."""
    plans = []
    for dp, slot in COORDS:
        items = [shard_item("w", [a, 0], [b - a, 3], (8, 3)) for a, b in LAYOUT.row_map(dp, slot, 8)]
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
    uniform = [SavePlan([shard_item("w", [2 * r, 0], [2, 3], (8, 3))]) for r in range(4)]
    plans = uniform + uniform  # a second, identical replica
    assert global_plan(plans).assignments[0].cuts is None
    # an irregular but disjoint tiling stays whole, though a grid would cut the first tile
    tiles = [SavePlan([shard_item("w", o, s, (4, 6))]) for o, s in (([0, 0], [4, 3]), ([0, 3], [2, 3]), ([2, 3], [2, 3]))]
    assert global_plan(tiles).assignments[0].cuts is None
