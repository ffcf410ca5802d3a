"""A rank's read items from an index load's columns: overlaps found in numpy, all keys at once.

DCP's ``create_default_local_load_plan`` walks every saved chunk of every key a rank
loads (a Python object and a loop step each), and the metadata must have built all those
objects first: at 1.19 M chunks that is seconds per rank before any byte moves. An index
load (``formats.index.IndexedKeys``) holds the saved chunks as numpy matrices; the
overlaps of every local shard with its key's chunks are a few vector operations over the
chunks of all the keys a rank loads (in batches, so memory stays bounded), and only
overlapping chunks become ``ReadItem``s. A non-tensor value, or a bytes key, goes through
DCP's own ``_create_read_items``; a load from a pickled ``.metadata`` through DCP's
planner whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_read_items
from torch.distributed.tensor import DTensor

from dcp_ext.errors import InvalidRequestError
from dcp_ext.formats.index import IndexedKeys
from dcp_ext.planning.local_shards import ChunkMemo, local_chunks
from dcp_ext.runtime.frozen import frozen
from dcp_ext.runtime.gc_pause import gc_paused

LocalShard = tuple[str, int, ChunkStorageMetadata]  # key, index in the tensor's chunk list, its box


@gc_paused()  # thousands of read items, no garbage
def local_read_items(state_dict: dict[str, Any], keys: IndexedKeys, strict: bool, source: str) -> list[ReadItem]:
    """What DCP's default local load plan holds for ``state_dict`` (same checks, DCP's
    messages after ``source``, the checkpoint, as ``InvalidRequestError``: both the
    ValueError and the RuntimeError DCP raises), computed from the index's columns."""
    items: list[ReadItem] = []
    shards: list[LocalShard] = []
    memo: ChunkMemo = {}
    for fqn, obj in state_dict.items():
        if fqn not in keys:
            if strict:  # DCP's message; an InvalidRequestError is also the RuntimeError DCP raises
                raise InvalidRequestError(f"{source}: Missing key in checkpoint state_dict: {fqn}.")
            continue
        facts = keys.facts(fqn)
        if facts is None or not isinstance(obj, torch.Tensor):
            items += _create_read_items(fqn, keys[fqn], obj)
            continue
        if facts[1] != obj.size():
            raise InvalidRequestError(f"{source}: Size mismatch between saved {facts[1]} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is outside the tensor's submesh
        shards += [(fqn, i, chunk) for i, chunk in enumerate(local_chunks(obj, memo))]
    return items + tensor_read_items(keys, shards)


BATCH_ROWS = 1 << 15  # saved chunks intersected at once: ~1 MB a matrix


def tensor_read_items(keys: IndexedKeys, shards: list[LocalShard]) -> list[ReadItem]:
    """Read items filling each local shard of a tensor key from the key's saved chunks:
    DCP's items, shard by shard as DCP lists them (a shard's saved chunks in metadata
    order, where DCP sweeps them by offset). Shards are intersected in batches of one
    ndim, keys in index order (so a batch's rows are often one run)."""
    ks, ndim, counts = keys.key_facts([fqn for fqn, _, _ in shards])
    by_layout = np.lexsort((ks, ndim))
    made: list[ReadItem] = []
    made_for: list[np.ndarray] = []  # the shard each made item fills
    for batch in _batches(ndim[by_layout], counts[by_layout]):
        picked = by_layout[batch]
        items, shard_of = _batch_read_items(keys, [shards[i] for i in picked.tolist()], ks[picked])
        made += items
        made_for.append(picked[shard_of])
    if not made:
        return []
    return [made[i] for i in np.argsort(np.concatenate(made_for), kind="stable").tolist()]


def _batches(ndim: np.ndarray, counts: np.ndarray) -> Iterator[slice]:
    """Runs of shards of one ndim whose keys hold up to BATCH_ROWS chunks together (a larger key alone)."""
    ends = np.cumsum(counts)
    first = 0
    while first < len(counts):
        same_ndim = first + int(np.searchsorted(ndim[first:], ndim[first], side="right"))  # ndim is sorted
        base = int(ends[first - 1]) if first else 0
        end = min(max(int(np.searchsorted(ends, base + BATCH_ROWS, side="right")), first + 1), same_ndim)
        yield slice(first, end)
        first = end


def _batch_read_items(keys: IndexedKeys, shards: list[LocalShard], ks: np.ndarray) -> tuple[list[ReadItem], np.ndarray]:
    """The read items of ``shards`` (of one ndim) and, for each, the shard it fills."""
    bounds, off, size = keys.stacked_boxes(ks)
    nd, counts = off.shape[1], np.diff(bounds)
    local = np.array([[*chunk.offsets, *chunk.sizes] for _, _, chunk in shards], np.int64).reshape(len(shards), 2 * nd)
    start = np.repeat(local[:, :nd], counts, axis=0)
    first = np.maximum(off, start)
    last = np.minimum(off + size, start + np.repeat(local[:, nd:], counts, axis=0))
    inside = np.ones(len(off), bool)
    for d in range(nd):  # dim by dim: cheaper than a per-row reduction
        inside &= last[:, d] > first[:, d]
    hits = np.flatnonzero(inside)
    shard_of = np.repeat(np.arange(len(shards)), counts)[hits]
    row = hits - bounds[shard_of]  # the saved chunk's place in its key's chunk list
    columns = (first - start)[hits], off[hits], (first - off)[hits], (last - first)[hits]
    # DCP's _create_read_item_for_tensor's items, built without their constructors (frozen)
    dest_indexes = [frozen(MetadataIndex, fqn=fqn, offset=chunk.offsets, index=i) for fqn, i, chunk in shards]
    items = []
    for s, r, dest, saved, storage, lengths in zip(shard_of.tolist(), row.tolist(), *(c.tolist() for c in columns)):
        items.append(
            frozen(
                ReadItem,
                type=LoadItemType.TENSOR,
                dest_index=dest_indexes[s],
                dest_offsets=torch.Size(dest),
                storage_index=frozen(MetadataIndex, fqn=shards[s][0], offset=torch.Size(saved), index=r),
                storage_offsets=torch.Size(storage),
                lengths=torch.Size(lengths),
            )
        )
    return items, shard_of
