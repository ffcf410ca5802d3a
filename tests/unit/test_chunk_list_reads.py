"""``load_plan.metadata_read_items`` plans what DCP plans, item for item and in its order,
where one local chunk is read without DCP's sweep (``_one_chunk_reads``).

DCP's own functions are the reference: ``create_read_items_for_chunk_list`` and
``create_default_local_load_plan``, on saved chunk lists that tile a tensor, leave it
partly uncovered, overlap (a corrupt checkpoint: DCP then reads every overlapping chunk,
in its sweep's order), hold empty chunks, or are pickled as lists.
"""

from __future__ import annotations

import itertools
import random

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_ext.planning.load_plan import chunk_list_reads, metadata_read_items


def described(items) -> list:
    """Every field of each item, the indexes' ``index`` hints too (a MetadataIndex compares without it)."""
    return [(item, item.dest_index.index, item.storage_index.index, type(item.dest_offsets), type(item.lengths)) for item in items]


def chunk(offsets, sizes, as_list: bool = False) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(list(offsets) if as_list else torch.Size(offsets), list(sizes) if as_list else torch.Size(sizes))


def grid(shape: tuple[int, ...], cuts: list[list[int]]) -> list[ChunkStorageMetadata]:
    """The chunks of ``shape`` cut at ``cuts`` in each dimension (a tiling), in row-major order."""
    bounds = [sorted({0, n, *c}) for n, c in zip(shape, cuts)]
    spans = [list(zip(b[:-1], b[1:])) for b in bounds]
    return [chunk([lo for lo, _ in box], [hi - lo for lo, hi in box]) for box in itertools.product(*spans)]


def random_box(rng: random.Random, shape: tuple[int, ...]) -> tuple[list[int], list[int]]:
    offsets = [rng.randrange(n + 1) for n in shape]
    return offsets, [rng.randrange(n - o + 1) for o, n in zip(offsets, shape)]


def saved_lists(rng: random.Random, shape: tuple[int, ...]) -> list[list[ChunkStorageMetadata]]:
    """Tilings, a tiling with a chunk left out, one with an overlapping chunk added, random boxes."""
    tiling = grid(shape, [rng.sample(range(1, n), min(2, n - 1)) if n > 1 else [] for n in shape])
    lists = [tiling, [chunk([0] * len(shape), shape)], tiling[1:], tiling + [chunk(*random_box(rng, shape))]]
    lists.append([chunk(*random_box(rng, shape)) for _ in range(rng.randrange(1, 5))])
    lists.append([chunk(c.offsets, c.sizes, as_list=True) for c in tiling])
    return lists


def test_one_local_chunk_reads_what_dcp_reads():
    rng = random.Random(5)
    checked = 0
    for shape in [(12,), (6, 8), (4, 5, 6), (), (0, 4), (7, 1)]:
        for saved in saved_lists(rng, shape):
            md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), saved)
            locals_ = [chunk([0] * len(shape), shape)] + [chunk(c.offsets, c.sizes) for c in saved[:3]]
            locals_ += [chunk(*random_box(rng, shape)) for _ in range(8)]
            for local in locals_:
                want = create_read_items_for_chunk_list("k", md, [local])
                assert described(chunk_list_reads("k", md, [local])) == described(want), (shape, saved, local)
                checked += 1
            several = locals_[:3]  # more than one local chunk: DCP's own sweep
            assert described(chunk_list_reads("k", md, several)) == described(create_read_items_for_chunk_list("k", md, several))
    assert checked > 200


def test_plain_tensors_are_planned_as_dcp_plans_them():
    """Keys saved whole, cut into pieces, or stored with an overlapping extra chunk: the
    plan of a state dict of plain tensors is DCP's, item for item."""
    rng = random.Random(8)
    state, keys = {}, {}
    for n, shape in enumerate([(16, 4), (9,), (), (3, 0), (5, 6, 2)] * 3):
        state[f"t{n}"] = torch.empty(shape)
        saved = saved_lists(rng, shape)[n % 6]
        keys[f"t{n}"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), saved)
    metadata = Metadata(state_dict_metadata=keys)
    want = create_default_local_load_plan(state, metadata, True).items
    assert described(metadata_read_items(state, metadata, True)) == described(want)
