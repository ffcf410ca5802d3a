"""How many threads one rank gives to file I/O: one rule for reads and writes.

Two threads per core the rank can count on: an I/O thread spends about half its time
blocked in the kernel (waiting for the disk or for page-cache copies), so two per core
keep both the disk queue and the cores busy, and more only add switching. The cores are
the process's CPU affinity shared among the ranks on its node (``LOCAL_WORLD_SIZE``, set
by torchrun and most launchers), so eight ranks on a 64-core node do not each start 16.
A read of bytes all in the page cache waits for nothing but its copy: one thread per core
then (``cores_per_rank``; ``ShardReader`` asks the page cache first).

And how they run: ``StartedPool`` starts all of a pool's threads before its first task.
``concurrent.futures.ThreadPoolExecutor`` starts one per submit, so every thread after the
first starts while the others read; on 2 busy cores such a start waited 0.9 ms for the GIL
(55 us on idle ones), 3-5 ms of a 16 ms load of 0.12 GB, on the thread that plans the reads.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from dcp_ext.runtime.options import positive_int

MIN_THREADS = 2  # even on one core: a read queued while another is copied
MAX_THREADS = 16


def io_thread_count(requested: int | None = None, owner: str = "") -> int:
    """``requested`` when given (a positive integer), else the rule above."""
    if requested is not None:
        return positive_int(owner, "thread_count", requested)
    return max(MIN_THREADS, min(MAX_THREADS, 2 * cores_per_rank()))


def cores_per_rank() -> int:
    """The cores this process can count on: its CPU affinity shared among the ranks on its node."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // _ranks_on_node())


def _ranks_on_node() -> int:
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else 1


T = TypeVar("T")
A = TypeVar("A")


class StartedPool:
    """A fixed pool of threads, all started up front, fed from one queue; used as a
    context manager (leaving it waits for every task) or closed with ``shutdown``.

    Plain daemon threads: they take work during interpreter exit.
    """

    def __init__(self, threads: int, name: str):
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        self._lock = threading.Lock()
        self._closed = False
        started = 0
        try:
            for thread in self._threads:
                thread.start()
                started += 1
        except BaseException:  # the threads that did start are stopped before the error goes on
            del self._threads[started:]
            self.shutdown()
            raise

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("StartedPool: cannot take work after shutdown")
            self._tasks.put((future, fn, args))
        return future

    def map(self, fn: Callable[[A], T], items: Iterable[A]) -> Iterator[T]:
        """``fn`` of every item, all submitted at once; results in order. The first error
        raises, and what has not started by then is cancelled."""
        futures = [self.submit(fn, item) for item in items]
        return self._results(futures)

    @staticmethod
    def _results(futures: list[Future[T]]) -> Iterator[T]:
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()

    def shutdown(self, cancel_futures: bool = False) -> None:
        """Wait for the running tasks; queued ones run too unless ``cancel_futures``. Safe
        to call again (it waits again: a first call cut short by an interrupt)."""
        with self._lock:
            if cancel_futures:
                self._cancel_queued()
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._tasks.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def _cancel_queued(self) -> None:
        """Cancel every queued task; the stop markers stay queued."""
        stops = 0
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is None:
                stops += 1
            else:
                task[0].cancel()
        for _ in range(stops):
            self._tasks.put(None)

    def __enter__(self) -> StartedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if future.set_running_or_notify_cancel():
                _settle(future, fn, *args)


def in_background(work: Callable[[], T], name: str) -> Future[T]:
    """``work()`` on a new daemon thread, its result or exception in the future."""
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()
    threading.Thread(target=_settle, args=(future, work), name=name, daemon=True).start()
    return future


def _settle(future: Future[T], fn: Callable[..., T], *args: Any) -> None:
    try:
        result = fn(*args)
    except BaseException as exc:  # handed to whoever waits on the future
        future.set_exception(exc)
    else:
        future.set_result(result)


def run_parallel(calls: Sequence[Callable[[], T]], name: str) -> list[T]:
    """Each call on a thread of its own; their results in order, or the first call's error
    once all have ended. ``StartedPool``'s plain threads, not ``concurrent.futures``: that
    refuses new work once the interpreter begins to exit, and an ``async_save`` nobody
    waited for finishes during exit (DCP's executor thread is joined then; stock's writer
    threads still start)."""
    with StartedPool(len(calls), name) as pool:
        futures = [pool.submit(call) for call in calls]
    return [future.result() for future in futures]
