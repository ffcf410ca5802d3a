"""A rank's read items from an index load's columns: overlaps found in numpy, per key.

DCP's ``create_default_local_load_plan`` walks every saved chunk of every key a rank
loads (a Python object and a loop step each), and the metadata must have built all those
objects first: at 1.19 M chunks that is seconds per rank before any byte moves. An index
load (``formats.index.IndexedKeys``) holds a key's saved chunks as two numpy matrices;
each local shard's overlap with them is a few vector operations, and only overlapping
chunks become ``ReadItem``s. A non-tensor value, or a bytes key, goes through DCP's own
``_create_read_items``; a load from a pickled ``.metadata`` through DCP's planner whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_read_item_for_tensor, _create_read_items
from torch.distributed.tensor import DTensor

from dcp_ext.errors import InvalidRequestError
from dcp_ext.formats.index import IndexedKeys


def local_read_items(state_dict: dict[str, Any], keys: IndexedKeys, strict: bool) -> list[ReadItem]:
    """What DCP's default local load plan holds for ``state_dict`` (same checks, same
    messages, as ``InvalidRequestError``: both the ValueError and the RuntimeError DCP
    raises), computed from the index's columns."""
    items: list[ReadItem] = []
    chunks_of: dict[tuple[Any, ...], list[ChunkStorageMetadata]] = {}
    for fqn, obj in state_dict.items():
        if fqn not in keys:
            if strict:  # DCP's message; an InvalidRequestError is also the RuntimeError DCP raises
                raise InvalidRequestError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        facts = keys.facts(fqn)
        if facts is None or not isinstance(obj, torch.Tensor):
            items += _create_read_items(fqn, keys[fqn], obj)
            continue
        if facts[1] != obj.size():
            raise InvalidRequestError(f"Size mismatch between saved {facts[1]} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is outside the tensor's submesh
        items += chunk_read_items(keys, fqn, _local_chunks(obj, chunks_of))
    return items


def _local_chunks(obj: torch.Tensor, chunks_of: dict[tuple[Any, ...], list[ChunkStorageMetadata]]) -> list[ChunkStorageMetadata]:
    """DCP's chunk list of ``obj``. A DTensor's (~50 us each, its local shape and offset
    worked out from its placements) is the same for every DTensor of its global shape,
    mesh and placements: computed once per such layout in a plan."""
    if type(obj) is not DTensor:
        return _create_chunk_list(obj)
    layout = (obj.shape, id(obj.device_mesh), obj.placements)
    chunks = chunks_of.get(layout)
    if chunks is None:
        chunks = chunks_of[layout] = _create_chunk_list(obj)
    return chunks


PYTHON_PAIRS = 8  # up to this many (local, saved) chunk pairs a key's overlaps are found in plain Python


def chunk_read_items(keys: IndexedKeys, fqn: str, local_chunks: list[ChunkStorageMetadata]) -> list[ReadItem]:
    """Read items filling ``local_chunks`` of tensor key ``fqn`` from its saved chunks.

    A key with many saved chunks is intersected in numpy; most keys have one or a few,
    where numpy's per-call cost (~1 us a call) would be most of the work."""
    off, size = keys.boxes(fqn)
    if len(off) * len(local_chunks) <= PYTHON_PAIRS:
        overlaps = _python_overlaps(off, size, local_chunks)
    else:
        overlaps = _numpy_overlaps(off, size, local_chunks)
    items = []
    for local_idx, local, row, start, first, last in overlaps:
        items.append(
            _create_read_item_for_tensor(
                dest_index=MetadataIndex(fqn, local.offsets, local_idx),
                dest_offsets=[a - b for a, b in zip(first, local.offsets)],
                storage_index=MetadataIndex(fqn, torch.Size(start), row),
                storage_offsets=[a - b for a, b in zip(first, start)],
                lengths=[b - a for a, b in zip(first, last)],
            )
        )
    return items


Overlap = tuple[int, ChunkStorageMetadata, int, list[int], list[int], list[int]]  # local idx, local, row, start, first, last


def _python_overlaps(off: np.ndarray, size: np.ndarray, local_chunks: list[ChunkStorageMetadata]) -> Iterator[Overlap]:
    """Each (local chunk, saved row) pair whose boxes intersect, with the intersection's corners."""
    saved = list(zip(off.tolist(), size.tolist()))
    for local_idx, local in enumerate(local_chunks):
        for row, (start, extent) in enumerate(saved):
            first = [max(a, b) for a, b in zip(start, local.offsets)]
            last = [min(a + n, b + m) for a, n, b, m in zip(start, extent, local.offsets, local.sizes)]
            if all(b > a for a, b in zip(first, last)):
                yield local_idx, local, row, start, first, last


def _numpy_overlaps(off: np.ndarray, size: np.ndarray, local_chunks: list[ChunkStorageMetadata]) -> Iterator[Overlap]:
    """What ``_python_overlaps`` yields, computed per local chunk over all saved chunks at once."""
    end = off + size
    for local_idx, local in enumerate(local_chunks):
        start = np.asarray(local.offsets, np.int64)
        lo = np.maximum(off, start)
        hi = np.minimum(end, start + np.asarray(local.sizes, np.int64))
        inside = np.ones(len(off), bool)
        for d in range(off.shape[1]):  # dim by dim: numpy's per-row reductions cost ~15 us a call
            inside &= hi[:, d] > lo[:, d]
        hits = np.flatnonzero(inside)
        for row, saved, first, last in zip(hits.tolist(), off[hits].tolist(), lo[hits].tolist(), hi[hits].tolist()):
            yield local_idx, local, row, saved, first, last
