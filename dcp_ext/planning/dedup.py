"""Refinement of partially overlapping chunks, and the data of a refined chunk.

DCP merges items by ``MetadataIndex(fqn, offset)`` alone, so replicas holding
overlapping chunks of different sizes (nonuniform TP: a reduced replica's rows [0, 4)
against a healthy core's [0, 2) and a spare's [2, 3)) end as overlapping chunks and a
failed save. The coordinator (``global_plan``) finds such keys and every rank splits
their chunks at the union of all boundaries (:func:`refine_items`), so every shared piece
is an identical sub-chunk that the ordinary dedup handles.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import find_tensor_shard

from dcp_ext.errors import InvalidRequestError
from dcp_ext.planning.local_shards import ChunkMemo, local_chunks

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
Cuts = dict[str, list[list[int]]]  # per key, per dim: the sorted boundaries to split at


def refine_items(items: list[WriteItem], cuts: Cuts) -> list[WriteItem]:
    """``items`` with the chunks of every key in ``cuts`` split at its boundaries, in order.
    The coordinator (on rebuilt items) and every rank (on its own) compute the same list."""
    return [piece for item in items for piece in _split(item, cuts.get(item.index.fqn))]


def chunk_view(obj: Any, item: WriteItem, memo: ChunkMemo, lookup: Callable[[MetadataIndex], Any] | None = None) -> torch.Tensor:
    """The local data of a tensor write item, also when refinement made it a sub-chunk of
    one of ``obj``'s local chunks (DCP's own lookup matches whole chunks only); a
    DTensor's chunks from the plan's ``memo``. ``lookup`` finds a whole local chunk's data
    by its index (a planner's ``lookup_object``; default: DCP's ``find_tensor_shard``)."""
    want = item.tensor_data.chunk
    for local in local_chunks(obj, memo):
        if _contains(local, want):
            index = MetadataIndex(item.index.fqn, local.offsets)
            data = find_tensor_shard(obj, index) if lookup is None else lookup(index)
            if 0 in want.sizes:  # an empty chunk: DTensor may describe it as (1, 0) over a (0, 0) local tensor
                return data.new_empty(tuple(want.sizes))
            for dim, (w, n, lo) in enumerate(zip(want.offsets, want.sizes, local.offsets)):
                data = data.narrow(dim, w - lo, n)
            return data
    raise InvalidRequestError(
        f"{item.index.fqn}: no local chunk holds the planned chunk at offsets "
        f"{list(want.offsets)} sizes {list(want.sizes)}"
    )


def _box(item: WriteItem) -> Box:
    chunk = item.tensor_data.chunk
    return tuple(chunk.offsets), tuple(chunk.sizes)


def _contains(outer: ChunkStorageMetadata, inner: ChunkStorageMetadata) -> bool:
    return all(
        o <= i and i + n <= o + s for i, n, o, s in zip(inner.offsets, inner.sizes, outer.offsets, outer.sizes)
    )


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))


def partially_overlap(boxes: set[Box]) -> bool:
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


def boundaries(boxes: set[Box]) -> list[list[int]]:
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
