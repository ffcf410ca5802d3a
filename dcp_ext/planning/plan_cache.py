"""Global save plans reused across saves of an unchanged state dict, and the tables they
were planned from.

A plan depends only on every rank's ``PlanTable`` (keys, tensor facts, chunk layout,
sizes) and the TP coordinates, all covered by the tables' digests, so the key is the tuple
of those digests: any change on any rank (a new key, another shape or dtype, a resharded
tensor) gives another key and a fresh plan. Checking costs one digest per rank, computed
by the rank itself over its columns. The replica check still runs on every save, since
it looks at data, not layout.

The coordinator also serves the tables of its cached plans by digest (``held_tables``):
a rank whose table it holds sends only the digest (``digest_exchange``), and a plan for a
changed layout takes the unchanged ranks' tables from here. Each rank remembers the
replica-check units of its last plans (``remembered_units``), keyed by the plan's id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

import numpy as np

from dcp_ext.planning.global_plan import GlobalPlan
from dcp_ext.planning.plan_table import PlanTable
from dcp_ext.planning.replica_units import ReplicaUnits
from dcp_ext.runtime.lru import Lru

CAPACITY = 2  # a training job alternates between few layouts (e.g. model-only vs full)

_plans: Lru[GlobalPlan] = Lru(CAPACITY)  # the key is the check: no further validation
_units: Lru[ReplicaUnits] = Lru(CAPACITY)  # this rank's units, by plan id


def plan_key(digests: Sequence[bytes], tp_ranks: Sequence[int | None] | None) -> tuple[Hashable, ...]:
    """The cache key of a save: every rank's table digest and, with replica locality, TP coordinate."""
    return tuple(digests), None if tp_ranks is None else tuple(tp_ranks)


def plan_id(key: tuple[Hashable, ...]) -> bytes:
    """16 bytes naming a key: what a rank's remembered units are filed under."""
    digests, tp_ranks = key
    h = hashlib.blake2b(b"".join(digests), digest_size=16)  # type: ignore[arg-type]
    h.update(b"-" if tp_ranks is None else np.array(tp_ranks, np.int64).tobytes())  # type: ignore[arg-type]
    return h.digest()


def cached_plan(key: Hashable) -> GlobalPlan | None:
    return _plans.get(key)


def remember_plan(key: Hashable, plan: GlobalPlan) -> None:
    _plans.put(key, plan)


def held_tables() -> dict[bytes, PlanTable]:
    """The tables of every cached plan, by digest."""
    return {t.digest: t for plan in _plans.values() for t in plan.structure.groups.tables}


def remember_units(units: ReplicaUnits) -> None:
    _units.put(units.plan_id, units)


def remembered_units(key_id: bytes) -> ReplicaUnits | None:
    return _units.get(key_id)


def clear_plan_cache() -> None:
    """Forget every cached global save plan and table (the next save plans from scratch)."""
    _plans.clear()
    _units.clear()
