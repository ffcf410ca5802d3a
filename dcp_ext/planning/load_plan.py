"""A rank's read items from an index load's columns: overlaps found in numpy, all keys at once.

DCP's ``create_default_local_load_plan`` walks every saved chunk of every key a rank
loads (a Python object and a loop step each), and the metadata must have built all those
objects first: at 1.19 M chunks that is seconds per rank before any byte moves. An index
load (``formats.index.IndexedKeys``) holds the saved chunks as numpy matrices; the
overlaps of every local shard with its key's chunks are a few vector operations over the
chunks of all the keys a rank loads (in batches, so memory stays bounded), and only
overlapping chunks become pieces: columns (``storage.read_columns.TensorReads``) that our
reader takes as they are and any other gets as ``ReadItem``s. A non-tensor value, or a
bytes key, goes through DCP's own ``_create_read_items``. A load from a pickled
``.metadata`` (or a Megatron or safetensors catalog) gets DCP's items key by key
(``metadata_read_items``), those of one local chunk built directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from dcp_ext.errors import InvalidRequestError
from dcp_ext.formats.index import IndexedKeys
from dcp_ext.planning.local_shards import ChunkMemo, local_chunks
from dcp_ext.runtime.frozen import frozen
from dcp_ext.storage.read_columns import TensorReads

LocalShard = tuple[str, int, ChunkStorageMetadata]  # key, index in the tensor's chunk list, its box


def local_reads(state_dict: dict[str, Any], keys: IndexedKeys, strict: bool, source: str) -> tuple[list[ReadItem], TensorReads]:
    """What DCP's default local load plan holds for ``state_dict`` (same checks, DCP's
    messages after ``source``, the checkpoint, as ``InvalidRequestError``: both the
    ValueError and the RuntimeError DCP raises), computed from the index's columns: the
    items of non-tensor values (DCP's), then the tensor pieces as columns, whose
    ``read_items`` follow in DCP's order."""
    items: list[ReadItem] = []
    shards: list[LocalShard] = []
    landings: list[torch.Tensor | None] = []
    dtypes: list[torch.dtype] = []
    memo: ChunkMemo = {}
    held: ChunkMemo = {}
    facts_of = keys.facts
    for fqn, obj in state_dict.items():
        try:
            facts = facts_of(fqn)
        except KeyError:
            if strict:  # DCP's message; an InvalidRequestError is also the RuntimeError DCP raises
                raise InvalidRequestError(f"{source}: Missing key in checkpoint state_dict: {fqn}.") from None
            continue
        if facts is None or not isinstance(obj, torch.Tensor):
            items += _create_read_items(fqn, keys[fqn], obj)
            continue
        if facts[1] != obj.size():
            raise InvalidRequestError(f"{source}: Size mismatch between saved {facts[1]} and current: {obj.size()} for {fqn}")
        if type(obj) is DTensor and type(obj._local_tensor) is torch.Tensor:
            chunks = _held_chunks(obj, facts[1], held)
        elif isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is outside the tensor's submesh
        else:
            chunks = local_chunks(obj, memo)
        if len(chunks) == 1:  # most: the tensor's whole local part
            shards.append((fqn, 0, chunks[0]))
            landings.append(landing_tensor(obj))
            dtypes.append(facts[0].dtype)
        else:
            shards += [(fqn, i, chunk) for i, chunk in enumerate(chunks)]
            landings += [None] * len(chunks)
            dtypes += [facts[0].dtype] * len(chunks)
    return items, tensor_reads(keys, shards, landings, dtypes)


def _held_chunks(obj: DTensor, size: torch.Size, held: ChunkMemo) -> list[ChunkStorageMetadata]:
    """A plain DTensor's local chunks (none where this rank is outside its submesh), worked
    out once per layout: its global ``size`` (checked against the saved one), mesh and
    placements, read from its spec (DTensor's own properties are Python calls: 590 keys,
    0.3 of a 2.0 ms local plan)."""
    spec = obj._spec
    layout = (size, id(spec.mesh), spec.placements)  # the meshes live as long as the plan
    chunks = held.get(layout)
    if chunks is None:
        chunks = held[layout] = [] if spec.mesh.get_coordinate() is None else local_chunks(obj, {})
    return chunks


def metadata_read_items(state_dict: dict[str, Any], metadata: Metadata, strict: bool) -> list[ReadItem]:
    """DCP's ``create_default_local_load_plan(state_dict, metadata, strict).items`` (its
    checks, errors and items, in its order) for metadata that is no index load (a pickled
    ``.metadata``, a Megatron or safetensors catalog), a plain DTensor's local chunks worked
    out once per layout (``local_chunks``): DCP works them out key by key, which was half
    of a 2-process local plan from a stock checkpoint (590 DTensors: ~25 of 48 ms); a
    tensor or plain DTensor of one local chunk read through ``_one_chunk_reads``."""
    items: list[ReadItem] = []
    memo: ChunkMemo = {}
    saved = metadata.state_dict_metadata
    for fqn, obj in state_dict.items():
        if fqn not in saved:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        md = saved[fqn]
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is outside the tensor's submesh
        if isinstance(md, TensorStorageMetadata) and type(obj) is DTensor:
            items += chunk_list_reads(fqn, md, local_chunks(obj, memo))
        elif isinstance(md, TensorStorageMetadata) and type(obj) is torch.Tensor:  # DCP's chunk: the whole tensor
            size = obj.size()
            reads = _one_chunk_reads(fqn, md, _origin(len(size)), size)
            items += _create_read_items(fqn, md, obj) if reads is None else reads
        else:
            items += _create_read_items(fqn, md, obj)
    return items


def chunk_list_reads(fqn: str, md: TensorStorageMetadata, chunks: list[ChunkStorageMetadata]) -> list[ReadItem]:
    """DCP's ``create_read_items_for_chunk_list(fqn, md, chunks)``; one local chunk goes
    through ``_one_chunk_reads`` first."""
    reads = _one_chunk_reads(fqn, md, chunks[0].offsets, chunks[0].sizes) if len(chunks) == 1 else None
    return create_read_items_for_chunk_list(fqn, md, chunks) if reads is None else reads


def _one_chunk_reads(fqn: str, md: TensorStorageMetadata, offsets: torch.Size, sizes: torch.Size) -> list[ReadItem] | None:
    """DCP's read items for one local chunk (``offsets``, ``sizes``) that overlaps one saved
    chunk or none (a load as saved, a shard inside a saved chunk), without DCP's sweep and
    constructors (``frozen``); None (DCP's to answer) where it overlaps several, whose order
    is DCP's sweep's, or a box is no ``torch.Size`` (DCP converts it). A stock checkpoint
    of 1,180 keys saved whole, one process: the local plan 10.7 -> 3.4 ms."""
    if type(offsets) is not torch.Size or type(sizes) is not torch.Size:
        return None
    hit = None
    for place, saved in enumerate(md.chunks):
        if (saved.offsets == offsets and saved.sizes == sizes and all(sizes)) or all(
                lo < so + ss and so < lo + ls for lo, ls, so, ss in zip(offsets, sizes, saved.offsets, saved.sizes)):
            if hit is not None or type(saved.offsets) is not torch.Size:
                return None
            hit = place
    if hit is None:
        return []
    saved = md.chunks[hit]
    if saved.offsets == offsets and saved.sizes == sizes:  # as saved (most keys)
        storage = dest = _origin(len(sizes))
        lengths = sizes
    else:  # DCP's overlap region
        bounds = list(zip(offsets, sizes, saved.offsets, saved.sizes))
        lengths = torch.Size([min(so + ss, lo + ls) - max(lo, so) for lo, ls, so, ss in bounds])
        storage = torch.Size([max(0, lo - so) for lo, _, so, _ in bounds])
        dest = torch.Size([max(0, so - lo) for lo, _, so, _ in bounds])
    return [frozen(
        ReadItem,
        type=LoadItemType.TENSOR,
        dest_index=frozen(MetadataIndex, fqn=fqn, offset=offsets, index=0),
        dest_offsets=dest,
        storage_index=frozen(MetadataIndex, fqn=fqn, offset=saved.offsets, index=hit),
        storage_offsets=storage,
        lengths=lengths,
    )]


_ORIGINS: dict[int, torch.Size] = {}


def _origin(ndim: int) -> torch.Size:
    """``torch.Size([0] * ndim)``, one object per number of dimensions (a size is immutable)."""
    origin = _ORIGINS.get(ndim)
    if origin is None:
        origin = _ORIGINS[ndim] = torch.Size([0] * ndim)
    return origin


def landing_tensor(obj: Any) -> torch.Tensor | None:
    """The memory a destination's reads land in, as ``ShardLoadPlanner.resolve_tensor``
    finds it: a plain DTensor's local tensor, a plain tensor itself (detached where it
    requires grad); None for anything else (DCP's resolution)."""
    if type(obj) is DTensor and type(obj._local_tensor) is torch.Tensor:  # not torchrec's LocalShardsWrapper
        local = obj._local_tensor
    elif type(obj) is torch.Tensor:
        local = obj
    else:
        return None
    return local.detach() if local.requires_grad else local  # only then: a detach gives up the GIL


BATCH_ROWS = 1 << 15  # saved chunks intersected at once: ~1 MB a matrix


def tensor_reads(
    keys: IndexedKeys,
    shards: list[LocalShard],
    landings: list[torch.Tensor | None] | None = None,
    dtypes: list[torch.dtype] | None = None,
) -> TensorReads:
    """The pieces filling each local shard of a tensor key from the key's saved chunks:
    DCP's read items as columns, shard by shard as DCP lists them (a shard's saved chunks
    in metadata order, where DCP sweeps them by offset). ``landings``: each shard's
    landing tensor (``landing_tensor``; None: none); ``dtypes``: each shard's saved dtype
    (None: looked up). Shards are intersected in batches of one ndim, keys in index order
    (so a batch's rows are often one run)."""
    ks, ndim, counts = keys.key_facts([fqn for fqn, _, _ in shards])
    by_layout = np.lexsort((ks, ndim))
    blocks: list[list[np.ndarray]] = []  # per batch: its columns
    made_for: list[np.ndarray] = []  # the shard each piece fills
    for batch in _batches(ndim[by_layout], counts[by_layout]):
        picked = by_layout[batch]
        columns, shard_of = _batch_pieces(keys, [shards[i] for i in picked.tolist()], ks[picked])
        blocks.append(columns)
        made_for.append(picked[shard_of])
    shard = np.concatenate(made_for) if made_for else np.zeros(0, np.int64)
    order = np.argsort(shard, kind="stable")
    if len(blocks) == 1:  # one ndim, up to BATCH_ROWS chunks (most loads): put in order before leaving numpy
        pieces = [_as_lists(column[order]) for column in blocks[0]]
    else:
        merged = [[value for block in blocks for value in _as_lists(block[c])] for c in range(7)]
        in_order = order.tolist()
        pieces = [[column[i] for i in in_order] for column in merged]
    rows, places, saved, sizes, dest, storage, lengths = pieces
    return TensorReads(
        keys=keys,
        fqns=[fqn for fqn, _, _ in shards],
        chunks=[chunk for _, _, chunk in shards],
        chunk_places=[place for _, place, _ in shards],
        dtypes=dtypes if dtypes is not None else [keys.facts(fqn)[0].dtype for fqn, _, _ in shards],
        landings=landings if landings is not None else [None] * len(shards),
        shard=shard[order].tolist(),
        rows=rows, places=places, saved_offsets=saved, saved_sizes=sizes,
        dest_offsets=dest, storage_offsets=storage, lengths=lengths,
    )


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


def _batch_pieces(keys: IndexedKeys, shards: list[LocalShard], ks: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """The pieces of ``shards`` (of one ndim): their columns (index rows, places in their
    keys' chunk lists, saved offsets and sizes, destination offsets, storage offsets,
    lengths; boxes as rows of a matrix) and, for each, the shard it fills."""
    bounds, off, size, key_rows = keys.stacked_boxes(ks)
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
    boxes = (off[hits], size[hits], (first - start)[hits], (first - off)[hits], (last - first)[hits])
    return [key_rows[hits], hits - bounds[shard_of], *boxes], shard_of  # place: in the key's chunk list


def _as_lists(column: np.ndarray) -> list[Any]:
    """A column as TensorReads holds it: numbers, or boxes as tuples."""
    return column.tolist() if column.ndim == 1 else list(map(tuple, column.tolist()))
