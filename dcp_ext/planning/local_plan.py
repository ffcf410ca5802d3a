"""The local SavePlan our planners send to the coordinator, with our extra fields.

DCP gathers each rank's ``SavePlan`` on the coordinator. We need a little more from every
rank (a digest per chunk for the replica check, the rank's tensor-parallel coordinate for
replica locality), so plans travel as this subclass and are turned back into plain
``SavePlan`` objects before DCP's own global planning sees them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan

ChunkKey = tuple[str, tuple[int, ...], tuple[int, ...]]  # fqn, offsets, sizes


@dataclasses.dataclass(frozen=True)
class ShardLocalPlan(SavePlan):
    chunk_digests: dict[ChunkKey, bytes] = dataclasses.field(default_factory=dict)
    tp_rank: int | None = None  # this rank's coordinate on the tensor-parallel mesh dim


_EXTRA_FIELDS = ("chunk_digests", "tp_rank")


def with_extras(plan: SavePlan, **extras: Any) -> ShardLocalPlan:
    """``plan`` carrying ``extras`` (and whatever extras it already had)."""
    base = {f.name: getattr(plan, f.name) for f in dataclasses.fields(SavePlan)}
    kept = {name: getattr(plan, name) for name in _EXTRA_FIELDS if hasattr(plan, name)}
    return ShardLocalPlan(**base, **{**kept, **extras})


def plain(plan: SavePlan) -> SavePlan:
    """The DCP SavePlan without our extras."""
    if type(plan) is SavePlan:
        return plan
    return SavePlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(SavePlan)})
