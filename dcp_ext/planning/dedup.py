"""Balanced deduplication of replicated save items.

DCP keeps one writer per replicated item greedily in first-seen order (two 200 B items
and a 400 B item on 2 ranks can end 200 B vs 600 B). We give every rank first the items
only it holds, then hand out replicated items largest first, each to the least loaded
rank that holds it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem


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
