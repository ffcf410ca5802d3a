"""How many threads one rank gives to file I/O: one rule for reads and writes.

Two threads per core the rank can count on: an I/O thread spends about half its time
blocked in the kernel (waiting for the disk or for page-cache copies), so two per core
keep both the disk queue and the cores busy, and more only add switching. The cores are
the process's CPU affinity shared among the ranks on its node (``LOCAL_WORLD_SIZE``, set
by torchrun and most launchers), so eight ranks on a 64-core node do not each start 16.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from dcp_ext.runtime.options import positive_int

MIN_THREADS = 2  # even on one core: a read queued while another is copied
MAX_THREADS = 16


def io_thread_count(requested: int | None = None, owner: str = "") -> int:
    """``requested`` when given (a positive integer), else the rule above."""
    if requested is not None:
        return positive_int(owner, "thread_count", requested)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(MIN_THREADS, min(MAX_THREADS, 2 * max(1, cores // _ranks_on_node())))


def _ranks_on_node() -> int:
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else 1


T = TypeVar("T")


def run_parallel(calls: Sequence[Callable[[], T]], name: str) -> list[T]:
    """Each call on a thread of its own; their results in order, or the first call's error
    once all have ended. Plain threads, not ``concurrent.futures``: that refuses new work
    once the interpreter begins to exit, and an ``async_save`` nobody waited for finishes
    during exit (DCP's executor thread is joined then; stock's writer threads still start)."""
    results: list[T | None] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # handed to the caller below
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results  # type: ignore[return-value]
