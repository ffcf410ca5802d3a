"""Global save plans reused across saves of an unchanged state dict.

A plan depends only on every rank's ``PlanTable`` (keys, tensor facts, chunk layout,
sizes) and the TP coordinates, all covered by the tables' digests, so the key is the tuple
of those digests: any change on any rank (a new key, another shape or dtype, a resharded
tensor) gives another key and a fresh plan. Checking costs one digest per rank, computed
by the rank itself over its columns. The replica check still runs on every save, since
it looks at data, not layout.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

from dcp_ext.planning.global_plan import GlobalPlan

CAPACITY = 2  # a training job alternates between few layouts (e.g. model-only vs full)

_lock = threading.Lock()
_plans: OrderedDict[Hashable, GlobalPlan] = OrderedDict()


def cached_plan(key: Hashable) -> GlobalPlan | None:
    with _lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
        return plan


def remember_plan(key: Hashable, plan: GlobalPlan) -> None:
    with _lock:
        _plans[key] = plan
        _plans.move_to_end(key)
        while len(_plans) > CAPACITY:
            _plans.popitem(last=False)


def clear_plan_cache() -> None:
    """Forget every cached global save plan (the next save plans from scratch)."""
    with _lock:
        _plans.clear()
