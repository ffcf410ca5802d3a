"""Global save planning without processes: object plans in, object plans out."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcp_ext.planning.global_plan import GlobalPlan, plan_globally
from dcp_ext.planning.local_plan import assigned_items
from dcp_ext.planning.plan_table import table_from_items


def shard_item(fqn: str, offsets, sizes, shape, dtype=torch.float32) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype), size=torch.Size(shape)),
    )


def global_plan(plans: list[SavePlan], **kwargs) -> GlobalPlan:
    return plan_globally([table_from_items(p.items) for p in plans], **kwargs)


def deduped(plans: list[SavePlan], **kwargs) -> list[SavePlan]:
    """What each rank writes after the coordinator's planning."""
    result = global_plan(plans, **kwargs)
    return [SavePlan(assigned_items(p.items, a)) for p, a in zip(plans, result.assignments)]


def digest_rows(*digests: bytes | None) -> np.ndarray:
    """Chunk-digest rows (16 bytes each, None for no digest) as ranks send them."""
    out = np.zeros((len(digests), 2), np.uint64)
    for row, d in enumerate(digests):
        if d is not None:
            out[row] = np.frombuffer(d.ljust(16, b"."), np.uint64)
    return out
