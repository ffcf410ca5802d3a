"""A rank's save plan as columns: what travels to the coordinator instead of WriteItems.

DCP gathers every rank's ``SavePlan`` (a Python object per item) on the coordinator, which
then loops over all of them. At 16,384 ranks x ~4,000 items that is ~65 M objects, far
beyond seconds. A ``PlanTable`` holds the same facts as numpy columns (one row per item)
plus the distinct keys and tensor facts once, and a digest of it all: ranks whose plans
are identical (data-parallel replicas) send identical tables, so the coordinator plans
each distinct table once (``dcp_ext.planning.global_plan``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

BYTE_IO = WriteItemType.BYTE_IO.value

TensorFacts = tuple[TensorProperties, torch.Size]  # what .metadata records per tensor key


@dataclasses.dataclass(frozen=True, eq=False)
class PlanTable:
    """One row per write item; ``fqns``/``facts`` hold each key once (``facts`` is None
    for non-tensor keys). Offsets and sizes are padded to ``offsets.shape[1]`` dims."""

    fqns: tuple[str, ...]
    facts: tuple[TensorFacts | None, ...]
    fqn_id: np.ndarray  # int32 (rows,)
    kind: np.ndarray  # int8 (rows,): WriteItemType values
    ndim: np.ndarray  # int8 (rows,)
    offsets: np.ndarray  # int64 (rows, dims)
    sizes: np.ndarray  # int64 (rows, dims)
    nbytes: np.ndarray  # int64 (rows,): bytes of the chunk (DCP's tensor_storage_size is the whole tensor's)
    mappings: Any  # DCP's flatten_state_dict mappings (SavePlan.planner_data)
    keys_digest: bytes  # of fqns, facts and mappings
    digest: bytes  # of everything above

    def __len__(self) -> int:
        return len(self.fqn_id)


def table_from_items(items: list[WriteItem], mappings: Any = None) -> PlanTable:
    """Encode a rank's write items (in order: row n is ``items[n]``)."""
    ids: dict[str, int] = {}
    facts: list[TensorFacts | None] = []
    fqn_id, kind, ndim, nbytes = [], [], [], []
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for item in items:
        fqn = item.index.fqn
        n = ids.get(fqn)
        if n is None:
            n = ids[fqn] = len(facts)
            data = item.tensor_data
            facts.append(None if data is None else (data.properties, data.size))
        fqn_id.append(n)
        kind.append(item.type.value)
        chunk = None if item.tensor_data is None else item.tensor_data.chunk
        box = ((), ()) if chunk is None else (tuple(chunk.offsets), tuple(chunk.sizes))
        boxes.append(box)
        ndim.append(len(box[0]))
        nbytes.append(0 if chunk is None else math.prod(box[1]) * item.tensor_data.properties.dtype.itemsize)
    dims = max(ndim, default=0) or 1
    offsets = np.zeros((len(items), dims), np.int64)
    sizes = np.ones((len(items), dims), np.int64)
    for row, (off, size) in enumerate(boxes):
        offsets[row, : len(off)] = off
        sizes[row, : len(size)] = size
    return make_table(tuple(ids), tuple(facts), fqn_id, kind, ndim, offsets, sizes, nbytes, mappings)


def make_table(
    fqns: tuple[str, ...],
    facts: tuple[TensorFacts | None, ...],
    fqn_id: Any,
    kind: Any,
    ndim: Any,
    offsets: np.ndarray,
    sizes: np.ndarray,
    nbytes: Any,
    mappings: Any = None,
) -> PlanTable:
    """A table from its columns (any array-likes), digests included."""
    columns = (
        np.asarray(fqn_id, np.int32),
        np.asarray(kind, np.int8),
        np.asarray(ndim, np.int8),
        np.asarray(offsets, np.int64),
        np.asarray(sizes, np.int64),
        np.asarray(nbytes, np.int64),
    )
    keys_digest = _keys_digest(fqns, facts, mappings)
    return PlanTable(fqns, facts, *columns, mappings, keys_digest, _digest(keys_digest, columns))


def items_from_table(table: PlanTable) -> list[WriteItem]:
    """The write items a table encodes (index hints left unset, as a local plan has them)."""
    items = []
    for fqn_id, kind, ndim, off, size in zip(
        table.fqn_id.tolist(), table.kind.tolist(), table.ndim.tolist(), table.offsets.tolist(), table.sizes.tolist()
    ):
        fqn, facts = table.fqns[fqn_id], table.facts[fqn_id]
        if kind == BYTE_IO or facts is None:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType(kind)))
            continue
        chunk = ChunkStorageMetadata(offsets=torch.Size(off[:ndim]), sizes=torch.Size(size[:ndim]))
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType(kind),
                tensor_data=TensorWriteData(chunk=chunk, properties=facts[0], size=facts[1]),
            )
        )
    return items


def _keys_digest(fqns: tuple[str, ...], facts: tuple[TensorFacts | None, ...], mappings: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update("\0".join(fqns).encode("utf-8", "surrogatepass"))
    # each key's properties as their values (a dataclass repr is Python code per field: 4 us a key)
    h.update(repr([None if f is None else (tuple(vars(f[0]).values()), f[1]) for f in facts]).encode())
    h.update(repr(mappings).encode())
    return h.digest()


def _digest(keys_digest: bytes, columns: tuple[np.ndarray, ...]) -> bytes:
    h = hashlib.blake2b(keys_digest, digest_size=16)
    for column in columns:
        h.update(repr((column.dtype.str, column.shape)).encode())
        h.update(np.ascontiguousarray(column).data)
    return h.digest()
