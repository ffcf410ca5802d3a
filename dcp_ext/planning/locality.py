"""TP-replica file locality: replicated tensors saved once per TP rank, in its own file.

A tensor replicated across tensor-parallel ranks (norms, biases, router weights) is
normally written once, so on load every other TP rank opens someone else's file for it.
With locality on, after the usual balanced dedup every TP group that holds a replicated
item also writes its own copy (still once per data-parallel group). The checkpoint keeps
the plain key: ``.metadata`` points at the canonical copy, so stock readers see an
ordinary checkpoint; the extra copies are recorded only in our index, and ShardReader
serves each rank from a copy in its own file when there is one.

Copies travel through DCP under a marked key (``copy_index``) that never reaches the
metadata; the writer maps them back with ``canonical_index``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

COPY_MARK = "\x00tp_copy:"  # cannot appear in a real state-dict key


def copy_index(index: MetadataIndex, tp_rank: int) -> MetadataIndex:
    return MetadataIndex(f"{index.fqn}{COPY_MARK}{tp_rank}", index.offset)


def canonical_index(index: MetadataIndex) -> MetadataIndex | None:
    """The item a copy duplicates, or None when ``index`` is not a copy."""
    fqn, mark, _ = index.fqn.partition(COPY_MARK)
    return MetadataIndex(fqn, index.offset) if mark else None


def tp_coordinate(state_dict: dict[str, Any], dim_name: str) -> int | None:
    """This rank's coordinate on the mesh dim ``dim_name`` of the state dict's DTensors."""
    for value in state_dict.values():
        if isinstance(value, DTensor) and dim_name in (value.device_mesh.mesh_dim_names or ()):
            return value.device_mesh.get_local_rank(dim_name)
    return None


def _nbytes(item: WriteItem) -> int:
    return item.tensor_storage_size() or 0


def add_replica_copies(
    local_plans: list[SavePlan], global_plans: list[SavePlan], tp_ranks: list[int | None]
) -> list[SavePlan]:
    """Give each TP group that holds a replicated tensor item, but does not write it, a copy.

    Within a group the copy goes to the least loaded holder. Items whose holders declare
    different chunk sizes (refined nonuniform-TP chunks) are left alone.
    """
    holders: dict[MetadataIndex, list[tuple[int, WriteItem]]] = defaultdict(list)
    for rank, plan in enumerate(local_plans):
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                holders[item.index].append((rank, item))
    writers = {item.index: (rank, item) for rank, plan in enumerate(global_plans) for item in plan.items}
    load = [sum(_nbytes(i) for i in plan.items) for plan in global_plans]
    extra: list[list[WriteItem]] = [[] for _ in global_plans]
    for index, held in holders.items():
        written = writers.get(index)
        if len(held) < 2 or written is None:
            continue
        sizes = {tuple(item.tensor_data.chunk.sizes) for _, item in held + [written]}
        if len(sizes) != 1:
            continue
        groups: dict[int, list[int]] = defaultdict(list)
        for rank, _ in held:
            if tp_ranks[rank] is not None:
                groups[tp_ranks[rank]].append(rank)
        for group, members in sorted(groups.items()):
            if group == tp_ranks[written[0]]:
                continue
            rank = min(members, key=lambda r: (load[r], r))
            extra[rank].append(dataclasses.replace(written[1], index=copy_index(index, group)))
            load[rank] += _nbytes(written[1])
    return [dataclasses.replace(plan, items=plan.items + more) if more else plan for plan, more in zip(global_plans, extra)]
