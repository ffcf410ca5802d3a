"""Balanced deduplication of replicated save items, after refining overlapping chunks.

DCP keeps one writer per replicated item greedily in first-seen order (two 200 B items
and a 400 B item on 2 ranks can end 200 B vs 600 B). We give every rank first the items
only it holds, then hand out replicated items largest first, each to the least loaded
rank that holds it.

DCP also merges items by ``MetadataIndex(fqn, offset)`` alone, so replicas holding
overlapping chunks of different sizes (nonuniform TP: a reduced replica's rows [0, 4)
against a healthy core's [0, 2) and a spare's [2, 3)) end as overlapping chunks and a
failed save. :func:`refine_overlapping_chunks` first splits such a tensor's chunks at
the union of their boundaries, so every shared piece is an identical sub-chunk.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.checkpoint.utils import find_tensor_shard

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _size(item: WriteItem) -> int:
    return item.tensor_storage_size() or 1  # bytes items count as tiny but not free


def balanced_dedup(plans: list[SavePlan]) -> list[SavePlan]:
    holders: dict[MetadataIndex, list[int]] = defaultdict(list)
    items: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders[item.index].append(rank)
            items.setdefault(item.index, item)
    load = [0] * len(plans)
    owner: dict[MetadataIndex, int] = {}
    replicated = []
    for index, ranks in holders.items():
        if len(ranks) == 1:
            owner[index] = ranks[0]
            load[ranks[0]] += _size(items[index])
        else:
            replicated.append(index)
    replicated.sort(key=lambda index: (-_size(items[index]), index.fqn))
    for index in replicated:
        rank = min(holders[index], key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += _size(items[index])
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if owner[item.index] == rank])
        for rank, plan in enumerate(plans)
    ]


def refine_overlapping_chunks(plans: list[SavePlan]) -> list[SavePlan]:
    """Split the chunks of every tensor whose chunks partially overlap at the union of all
    its chunk boundaries; tensors whose chunks are identical or disjoint are untouched."""
    boxes: dict[str, set[Box]] = defaultdict(set)
    for item in _tensor_items(plans):
        boxes[item.index.fqn].add(_box(item))
    cuts = {fqn: _boundaries(found) for fqn, found in boxes.items() if _partially_overlap(found)}
    if not cuts:
        return plans
    return [
        dataclasses.replace(
            plan,
            items=[piece for item in plan.items for piece in _split(item, cuts.get(item.index.fqn))],
        )
        for plan in plans
    ]


def chunk_view(obj: Any, item: WriteItem) -> torch.Tensor:
    """The local data of a tensor write item, also when refinement made it a sub-chunk of
    one of ``obj``'s local chunks (DCP's own lookup matches whole chunks only)."""
    want = item.tensor_data.chunk
    for local in _create_chunk_list(obj):
        if _contains(local, want):
            data = find_tensor_shard(obj, MetadataIndex(item.index.fqn, local.offsets))
            for dim, (w, n, lo) in enumerate(zip(want.offsets, want.sizes, local.offsets)):
                data = data.narrow(dim, w - lo, n)
            return data
    raise ValueError(
        f"{item.index.fqn}: no local chunk holds the planned chunk at offsets "
        f"{list(want.offsets)} sizes {list(want.sizes)}"
    )


def _tensor_items(plans: list[SavePlan]) -> list[WriteItem]:
    return [i for p in plans for i in p.items if i.type != WriteItemType.BYTE_IO and i.tensor_data is not None]


def _box(item: WriteItem) -> Box:
    chunk = item.tensor_data.chunk
    return tuple(chunk.offsets), tuple(chunk.sizes)


def _contains(outer: ChunkStorageMetadata, inner: ChunkStorageMetadata) -> bool:
    return all(
        o <= i and i + n <= o + s for i, n, o, s in zip(inner.offsets, inner.sizes, outer.offsets, outer.sizes)
    )


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))


def _partially_overlap(boxes: set[Box]) -> bool:
    """Whether two distinct non-empty boxes overlap (scalars never do). A sweep along the
    dim with the most distinct offsets, so a sharded dim keeps the active set small."""
    found = [b for b in boxes if b[0] and all(b[1])]
    if len(found) < 2:
        return False
    dim = max(range(len(found[0][0])), key=lambda d: len({o[d] for o, _ in found}))
    found.sort(key=lambda b: b[0][dim])
    active: list[tuple[int, int]] = []  # (end along dim, index into found)
    for n, box in enumerate(found):
        start = box[0][dim]
        del active[: bisect.bisect_right(active, (start, len(found)))]
        if any(_overlap(box, found[other]) for _, other in active):
            return True
        bisect.insort(active, (start + box[1][dim], n))
    return False


def _boundaries(boxes: set[Box]) -> list[list[int]]:
    """Per dim, the sorted offsets and ends of all boxes."""
    ndim = len(next(iter(boxes))[0])
    return [sorted({o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d in range(ndim)]


def _split(item: WriteItem, cuts: list[list[int]] | None) -> list[WriteItem]:
    """The item's cells between ``cuts`` (per-dim boundaries), as shard items."""
    if cuts is None or not all(_box(item)[1]):
        return [item]
    offsets, sizes = _box(item)
    spans = []  # per dim, the (start, length) cells inside the item
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        inner = cuts[d][bisect.bisect_right(cuts[d], o) : bisect.bisect_left(cuts[d], o + s)]
        edges = [o, *inner, o + s]
        spans.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    if all(len(dim_spans) == 1 for dim_spans in spans):
        return [item]
    pieces = []
    for cell in itertools.product(*spans):
        chunk = ChunkStorageMetadata(offsets=torch.Size(c[0] for c in cell), sizes=torch.Size(c[1] for c in cell))
        pieces.append(
            WriteItem(
                index=MetadataIndex(item.index.fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk),
            )
        )
    return pieces
