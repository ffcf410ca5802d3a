"""Global save plans reused across saves of an unchanged state dict.

A plan depends only on every rank's ``PlanTable`` (keys, tensor facts, chunk layout,
sizes) and the TP coordinates, all covered by the tables' digests, so the key is the tuple
of those digests: any change on any rank (a new key, another shape or dtype, a resharded
tensor) gives another key and a fresh plan. Checking costs one digest per rank, computed
by the rank itself over its columns. The replica check still runs on every save, since
it looks at data, not layout.
"""

from __future__ import annotations

from collections.abc import Hashable

from dcp_ext.planning.global_plan import GlobalPlan
from dcp_ext.runtime.lru import Lru

CAPACITY = 2  # a training job alternates between few layouts (e.g. model-only vs full)

_plans: Lru[GlobalPlan] = Lru(CAPACITY)  # the key is the check: no further validation


def cached_plan(key: Hashable) -> GlobalPlan | None:
    return _plans.get(key)


def remember_plan(key: Hashable, plan: GlobalPlan) -> None:
    _plans.put(key, plan)


def clear_plan_cache() -> None:
    """Forget every cached global save plan (the next save plans from scratch)."""
    _plans.clear()
