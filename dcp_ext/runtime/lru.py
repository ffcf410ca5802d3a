"""The one cache class: a small thread-safe LRU whose entries are checked before use.

Parsed checkpoint metadata, Megatron sources, torch_dist views and global save plans are
all "expensive to build, cheap to check" values: an entry is returned only while the
caller's check still accepts it (a file signature, the identity of what it was built
from), else it is dropped. Every cache registers itself so ``clear_caches()`` empties them
all.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

_ALL: weakref.WeakSet[Lru] = weakref.WeakSet()


class Lru(Generic[V]):
    """At most ``capacity`` entries and, with ``weigh``, entries weighing ``max_weight`` in
    all (the newest entry stays even when it weighs more on its own)."""

    def __init__(self, capacity: int, weigh: Callable[[V], int] | None = None, max_weight: int = 0):
        self.capacity = capacity
        self.weigh, self.max_weight = weigh, max_weight
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._weights: dict[Hashable, int] = {}
        self._lock = threading.Lock()
        _ALL.add(self)

    def get(self, key: Hashable, valid: Callable[[V], bool] = lambda _: True) -> V | None:
        """The entry for ``key`` if ``valid`` accepts it (called outside the lock); a
        rejected entry is dropped."""
        with self._lock:
            value = self._entries.get(key)
        if value is None:
            return None
        if not valid(value):
            self.discard(key, value)
            return None
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
        return value

    def put(self, key: Hashable, value: V) -> None:
        weight = self.weigh(value) if self.weigh is not None else 0
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            self._weights[key] = weight
            while len(self._entries) > self.capacity or (
                self.weigh is not None and len(self._entries) > 1 and sum(self._weights.values()) > self.max_weight
            ):
                oldest, _ = self._entries.popitem(last=False)
                del self._weights[oldest]

    def discard(self, key: Hashable, value: V | None = None) -> None:
        """Drop ``key`` (only while it still holds ``value``, when given)."""
        with self._lock:
            if key in self._entries and (value is None or self._entries[key] is value):
                del self._entries[key]
                del self._weights[key]

    def values(self) -> list[V]:
        """The entries, least recently used first (unchecked: for callers whose key is the check)."""
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._weights.clear()

    def __len__(self) -> int:
        return len(self._entries)


def clear_caches() -> None:
    """Forget everything cached in this process: checkpoint metadata, Megatron sources and
    views, global save plans. The next load or save reads and plans from scratch."""
    for cache in list(_ALL):
        cache.clear()
