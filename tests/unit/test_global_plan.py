"""Global save planning without processes: balanced dedup, validation, file balancing,
and the numpy kernels behind them (grid tiling test, water filling)."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

import dcp_ext
from dcp_ext import CheckpointError, InvalidRequestError
from dcp_ext.formats import index as index_module
from dcp_ext.megatron import IncompleteSaveError
from dcp_ext.planning import global_plan as global_plan_module
from dcp_ext.planning import global_plan as plan_kernels
from dcp_ext.planning.global_plan import _concat, _fill, _group_ranks, _keyed_box_order, _lexsorted_box_order, _tiles, _unique_boxes, holder_classes, plan_globally
from dcp_ext.planning.replica_check import ReplicaMismatchError
from dcp_ext.planning.replica_units import units_per_group
from dcp_ext.planning.plan_table import make_table
from dcp_ext.storage.writer import item_nbytes, split_by_bytes

from support import deduped, global_plan, shard_item


def _item(fqn: str, nbytes: int) -> WriteItem:
    size = torch.Size([nbytes])
    return WriteItem(
        index=MetadataIndex(fqn, [0]),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([0]), size),
            properties=TensorProperties(dtype=torch.uint8),
            size=size,
        ),
    )


def _bytes_per_rank(plans: list[SavePlan]) -> list[int]:
    return [sum(i.tensor_storage_size() for i in p.items) for p in plans]


def test_balanced_where_first_seen_greedy_is_not():
    # stock DCP's first-seen greedy dedup ends 200 B vs 600 B here; 400/400 is possible
    plans = [
        SavePlan([_item("r1", 200), _item("r2", 200)]),
        SavePlan([_item("r1", 200), _item("r2", 200), _item("own", 400)]),
    ]
    written = deduped(plans)
    assert _bytes_per_rank(written) == [400, 400]


def test_every_item_written_exactly_once_by_a_holder():
    plans = [SavePlan([_item(f"t{k}", 10 * (k + 1)) for k in range(r, 12)]) for r in range(4)]
    written = deduped(plans)
    names = [i.index.fqn for p in written for i in p.items]
    assert sorted(names) == sorted(f"t{k}" for k in range(12))
    for rank, plan in enumerate(written):
        assert all(int(i.index.fqn[1:]) >= rank for i in plan.items)  # only holders write
    loads = _bytes_per_rank(written)
    assert max(loads) - min(loads) <= 120


def test_an_invalid_global_plan_is_a_checkpoint_error_and_a_value_error():
    """Chunks that leave part of a tensor unsaved: DCP raises ValueError, we a subclass of both."""
    plans = [SavePlan([shard_item("w", [0], [3], [8])]), SavePlan([shard_item("w", [4], [4], [8])])]
    with pytest.raises(InvalidRequestError, match="Failed to validate global plan") as info:
        global_plan(plans)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)


@pytest.mark.skipif(not index_module._HAS_STRIDES, reason="torch < 2.15 records no strides")
def test_uneven_shards_strides_differ_but_other_facts_must_agree():
    """torch >= 2.15 records each rank's local strides: rows 0-4 and 5-7 of an (8, 3)
    tensor sharded on dim 1 have strides (2, 1) and (1, 1); the plan keeps the first rank's,
    as stock DCP does. A dtype that differs is still refused."""
    def item(offset, size, strides, dtype=torch.float32):
        made = shard_item("w", [0, offset], [8, size], [8, 3], dtype)
        made.tensor_data.properties.strides = strides
        return made

    result = global_plan([SavePlan([item(0, 2, (2, 1))]), SavePlan([item(2, 1, (1, 1))])])
    assert result.metadata.state_dict_metadata["w"].properties.strides == (2, 1)
    with pytest.raises(InvalidRequestError, match="different tensor facts"):
        global_plan([SavePlan([item(0, 2, (2, 1))]), SavePlan([item(2, 1, (1, 1), torch.float16)])])


def test_every_public_error_derives_from_checkpoint_error():
    errors = [getattr(dcp_ext, n) for n in dcp_ext.__all__ if n.endswith("Error")] + [IncompleteSaveError]
    assert {e.__name__ for e in errors} >= {"CheckpointError", "InvalidRequestError", "ReplicaMismatchError"}
    for error in errors:
        assert issubclass(error, dcp_ext.CheckpointError), error
    assert issubclass(dcp_ext.ReplicaMismatchError, ValueError)  # as before: callers may catch ValueError


def test_a_rank_spreads_its_items_over_files_by_chunk_bytes():
    """Each shard weighs its own bytes, not its whole tensor's (tensor_storage_size)."""
    items = [
        shard_item("a", [0, 0], [900, 10], [1000, 10]),
        shard_item("a", [900, 0], [100, 10], [1000, 10]),
        shard_item("b", [0, 0], [100, 10], [4000, 10]),
        shard_item("c", [0, 0], [500, 10], [500, 10]),
    ]
    files = split_by_bytes(items, 2)
    assert sorted(sum(item_nbytes(i) for i in f) for f in files) == [700 * 40, 900 * 40]


# -- the numpy kernels of the coordinator's plan -------------------------------------------
def boxes(*pairs: tuple[list[int], list[int]]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([o for o, _ in pairs]).reshape(len(pairs), -1), np.array([s for _, s in pairs]).reshape(len(pairs), -1)


@pytest.mark.parametrize(
    "pairs,shape,tiles",
    [
        ([([0, 0], [2, 3]), ([2, 0], [2, 3])], (4, 3), True),  # row shards
        ([([0, 0], [2, 2]), ([0, 2], [2, 1]), ([2, 0], [2, 2]), ([2, 2], [2, 1])], (4, 3), True),  # a 2 x 2 grid
        ([([2, 0], [2, 3]), ([0, 0], [2, 3])], (4, 3), True),  # any order
        ([([0, 0], [2, 3])], (4, 3), False),  # a gap
        ([([0, 0], [3, 3]), ([2, 0], [2, 3])], (4, 3), False),  # an overlap
        ([([0, 0], [2, 3]), ([2, 0], [3, 3])], (4, 3), False),  # out of bounds
        ([([0, 0], [4, 3]), ([0, 3], [2, 3]), ([2, 3], [2, 3])], (4, 6), False),  # disjoint, but no grid
        ([([0, 0], [2, 3]), ([0, 0], [2, 3]), ([2, 0], [2, 3])], (4, 3), False),  # a duplicate
    ],
)
def test_tiles_accepts_exactly_the_grids_that_cover_the_shape(pairs, shape, tiles, monkeypatch):
    off, size = boxes(*pairs)
    assert _tiles(off, size, shape) is tiles  # a few chunks: checked on lists
    monkeypatch.setattr(plan_kernels, "LISTED_TILES_CHUNKS", 0)
    assert _tiles(off, size, shape) is tiles  # many: in numpy


def test_tiles_on_lists_and_in_numpy_agree_on_random_layouts(monkeypatch):
    """A key of up to ``LISTED_TILES_CHUNKS`` chunks is checked on lists, a larger one in
    numpy: both give the same answer for grids, grids with a cell dropped, doubled, moved
    or resized, and random boxes, in 1-3 dimensions with empty extents among them."""
    rng = np.random.default_rng(0)
    listed = lambda off, size, shape: plan_kernels._tiles_listed(off.tolist(), size.tolist(), shape)  # noqa: E731
    monkeypatch.setattr(plan_kernels, "LISTED_TILES_CHUNKS", -1)
    answers = []
    for _ in range(3_000):
        shape = tuple(int(e) for e in rng.integers(0, 7, rng.integers(1, 4)))
        cuts = [sorted({0, e, *rng.integers(0, e + 1, rng.integers(0, 3)).tolist()}) for e in shape]
        cells = np.array(np.meshgrid(*[np.arange(max(1, len(c) - 1)) for c in cuts], indexing="ij")).reshape(len(shape), -1).T
        off = np.array([[c[i] if len(c) > 1 else 0 for c, i in zip(cuts, cell)] for cell in cells], np.int64)
        size = np.array([[c[i + 1] - c[i] if len(c) > 1 else 0 for c, i in zip(cuts, cell)] for cell in cells], np.int64)
        change = rng.integers(0, 6)
        row, dim = rng.integers(0, len(off)), rng.integers(0, len(shape))
        if change == 1:
            off, size = np.delete(off, row, 0), np.delete(size, row, 0)
        elif change == 2:
            off, size = np.concatenate([off, off[row : row + 1]]), np.concatenate([size, size[row : row + 1]])
        elif change == 3:
            off[row, dim] += rng.integers(-2, 3)
        elif change == 4:
            size[row, dim] += rng.integers(-2, 3)
        elif change == 5:
            off, size = rng.integers(-1, 5, off.shape), rng.integers(-1, 5, size.shape)
        if len(off):
            answers.append(_tiles(off, size, shape))
            assert answers[-1] is listed(off, size, shape), (off.tolist(), size.tolist(), shape)
    assert 0.2 < sum(answers) / len(answers) < 0.8  # both kinds of answer were asked for


@pytest.mark.parametrize(
    "weights,loads",
    [
        ([5, 4, 3, 2, 1], [0, 0, 0]),
        ([8, 1, 1, 1, 1], [0, 0]),
        ([3, 3, 3, 3], [10, 0, 0]),  # the loaded member gets nothing
        ([1] * 12, [0, 2, 4, 6]),
        ([7], [3, 1]),
    ],
)
def test_fill_levels_the_load_within_one_box_of_the_water_level(weights, loads):
    members = np.arange(len(loads)) + 10  # rank numbers, not positions
    load = np.zeros(20, np.int64)
    load[members] = loads
    weight = np.array(weights, np.int64)
    chosen = _fill(members, weight, load)
    assert set(chosen.tolist()) <= set(members.tolist())
    after = load.copy()
    np.add.at(after, chosen, weight)
    level = (weight.sum() + sum(loads)) / len(loads)  # the level if boxes could be split
    filled = [m for m in members.tolist() if m in chosen.tolist()]
    assert all(after[m] <= max(level, load[m]) + weight.max() for m in members.tolist())
    assert all(load[m] < level for m in filled)  # nobody above the level is given more


def _random_tables(rng: np.random.Generator, ranks: int, keys: int, shuffled: bool = False) -> list:
    """Tables of ``ranks`` ranks over ``keys`` keys of 1-3 dims, each key split as a grid
    and its chunks dealt to random subsets of ranks (replicas and unique chunks mixed);
    rows in key order, or ``shuffled``."""
    shapes = [tuple(int(v) for v in rng.integers(1, 9, rng.integers(1, 4))) for _ in range(keys)]
    facts = tuple((TensorProperties(dtype=torch.float32), torch.Size(shape)) for shape in shapes)
    fqns = tuple(f"k{n}" for n in range(keys))
    rows: list[list[tuple[int, list[int], list[int]]]] = [[] for _ in range(ranks)]
    for k, shape in enumerate(shapes):
        cuts = [np.unique(np.concatenate([[0, extent], rng.integers(0, extent + 1, 2)])) for extent in shape]
        for cell in np.ndindex(*(len(c) - 1 for c in cuts)):
            off = [int(cuts[d][i]) for d, i in enumerate(cell)]
            size = [int(cuts[d][i + 1]) - off[d] for d, i in enumerate(cell)]
            for rank in rng.choice(ranks, int(rng.integers(1, ranks + 1)), replace=False).tolist():
                rows[rank].append((k, off, size))
    tables = []
    for rank_rows in rows:
        if shuffled:
            rng.shuffle(rank_rows)
        n = len(rank_rows)
        offsets, sizes = np.zeros((n, 3), np.int64), np.ones((n, 3), np.int64)
        for row, (_, off, size) in enumerate(rank_rows):
            offsets[row, : len(off)], sizes[row, : len(size)] = off, size
        fqn_id = [k for k, _, _ in rank_rows]
        tables.append(
            make_table(fqns, facts, fqn_id, [WriteItemType.SHARD.value] * n, [len(shapes[k]) for k in fqn_id], offsets, sizes, [4 * int(np.prod(s)) for _, _, s in rank_rows])
        )
    return tables


@pytest.mark.parametrize("seed", range(6))
def test_the_one_key_sort_orders_rows_as_the_lexsort_does(seed):
    rows = _concat(_random_tables(np.random.default_rng(seed), ranks=5, keys=7, shuffled=seed % 2 == 1))
    keyed = _keyed_box_order(rows)
    assert keyed is not None
    expected = _lexsorted_box_order(rows)
    assert np.array_equal(keyed.order, expected.order) and np.array_equal(keyed.new, expected.new)
    assert np.array_equal(keyed.fqn, expected.fqn)
    for decoded, taken in zip(keyed.chunks, expected.chunks):  # the boxes' ndim, offsets and sizes, decoded from the codes
        assert np.array_equal(decoded, taken)


def test_the_one_key_sort_leaves_chunks_it_cannot_order_to_the_lexsort():
    facts = ((TensorProperties(dtype=torch.float32), torch.Size([8])),)
    def rows_of(*boxes):
        tables = [make_table(("w",), facts, [0], [WriteItemType.SHARD.value], [1], [[off]], [[size]], [4 * size]) for off, size in boxes]
        return _concat(tables)
    assert _keyed_box_order(rows_of((0, 4), (4, 4))) is not None
    assert _keyed_box_order(rows_of((0, 4), (6, 4))) is None  # past the end
    assert _keyed_box_order(rows_of((0, 4), (0, 6))) is None  # one offset, two sizes


@pytest.mark.parametrize("collide", [False, True])
def test_holder_classes_group_boxes_by_exactly_their_holders(monkeypatch, collide):
    if collide:  # every holder set hashes alike: only the exact comparison separates them
        monkeypatch.setattr(global_plan_module, "_holder_words", lambda n: np.zeros(n, np.uint64))
    tables = _random_tables(np.random.default_rng(7), ranks=6, keys=9)
    groups = _group_ranks(tables)
    rows = _concat(groups.tables)
    boxes = _unique_boxes(rows)
    classes = holder_classes(groups, rows, boxes)
    expected: dict[tuple[int, ...], int] = {}
    for box in range(len(boxes.fqn)):
        holding = tuple(rows.gid[boxes.order[boxes.starts[box] : boxes.ends[box]]].tolist())
        cls = holding[0] if len(holding) == 1 else expected.setdefault(holding, len(groups.members) + len(expected))
        assert classes.of_box[box] == cls
        assert np.array_equal(classes.members[cls], np.sort(np.concatenate([groups.members[g] for g in holding])))
    assert len(classes.members) == len(groups.members) + len(expected)


def test_replica_units_are_each_groups_shared_classes_in_chunk_order():
    tables = _random_tables(np.random.default_rng(11), ranks=6, keys=9)
    plan = plan_globally(tables)
    units = units_per_group(plan, b"id")
    assert sum(len(u.classes) for u in units) > 3  # chunks shared by several groups
    rows, boxes, classes = plan.structure.rows, plan.structure.boxes, plan.structure.classes
    for group, mine in enumerate(units):
        expected_classes, expected_rows = [], []
        for cls in range(len(classes.members)):
            if len(classes.members[cls]) < 2:
                continue
            held = []
            for box in np.flatnonzero(classes.of_box == cls).tolist():
                sorted_rows = boxes.order[boxes.starts[box] : boxes.ends[box]]
                held += [int(r - rows.starts[group]) for r in sorted_rows.tolist() if rows.gid[r] == group]
            if held:
                expected_classes.append(cls)
                expected_rows.append(held)
        assert mine.classes.tolist() == expected_classes
        assert [mine.rows[lo:hi].tolist() for lo, hi in zip(mine.bounds[:-1], mine.bounds[1:])] == expected_rows


def _row_chunk(table, row: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    ndim = int(table.ndim[row])
    return int(table.fqn_id[row]), tuple(table.offsets[row, :ndim].tolist()), tuple(table.sizes[row, :ndim].tolist())


@pytest.mark.parametrize("seed", range(4))
def test_every_rank_writes_and_copies_rows_of_its_own_table_holding_the_chunk(seed):
    replicas = 2 if seed >= 2 else 1  # seeds 2, 3: each table held by two ranks (one group)
    tables = _random_tables(np.random.default_rng(seed), ranks=6 // replicas, keys=9, shuffled=seed % 2 == 1) * replicas
    plan = plan_globally(tables, tp_ranks=[r % 2 for r in range(6)])
    boxes = plan.structure.boxes
    written = {}
    for rank, assignment in enumerate(plan.assignments):
        for row in assignment.rows.tolist():
            written.setdefault(_row_chunk(tables[rank], row), []).append(rank)
        for row in assignment.copy_rows.tolist():
            assert _row_chunk(tables[rank], row) in {_row_chunk(tables[rank], r) for r in range(len(tables[rank]))}
    assert len(written) == len(boxes.fqn) and all(len(ranks) == 1 for ranks in written.values())  # each chunk once
    assert sum(len(a.copy_rows) for a in plan.assignments) > 0


def test_replica_check_finds_each_disagreeing_chunk_of_a_random_layout():
    rng = np.random.default_rng(3)
    tables = _random_tables(rng, ranks=6, keys=9)
    digests = []
    for table in tables:  # a digest per chunk, equal wherever the chunk is
        words = [hash(_row_chunk(table, row)) & (2**63 - 1) | 1 for row in range(len(table))]
        digests.append(np.array([[w, w ^ 5] for w in words], np.uint64).reshape(-1, 2))
    plan_globally(tables, chunk_digests=[pickle.loads(pickle.dumps(d)) for d in digests])  # unpickled, as gathered
    holders: dict[tuple, list[int]] = {}
    for rank, table in enumerate(tables):
        for row in range(len(table)):
            holders.setdefault(_row_chunk(table, row), []).append(rank)
    shared = [chunk for chunk, ranks in holders.items() if len(ranks) > 2]
    target = shared[int(rng.integers(len(shared)))]
    odd_rank = holders[target][1]
    odd_row = next(r for r in range(len(tables[odd_rank])) if _row_chunk(tables[odd_rank], r) == target)
    digests[odd_rank][odd_row] ^= np.uint64(8)
    others = [r for r in holders[target] if r != odd_rank]
    versions = [re.escape(f"ranks {others} vs ranks [{odd_rank}]"), re.escape(f"ranks [{odd_rank}] vs ranks {others}")]
    with pytest.raises(ReplicaMismatchError, match="|".join(versions)) as caught:
        plan_globally(tables, chunk_digests=digests)
    assert f"chunk at offsets {list(target[1])} size {list(target[2])}" in str(caught.value)
    digests[odd_rank] = digests[odd_rank][:odd_row]  # the odd row and the rest unknown: compared with nothing
    plan_globally(tables, chunk_digests=digests)
