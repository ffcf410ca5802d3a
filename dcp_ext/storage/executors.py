"""Executors: how one rank's byte-range requests are run, whatever format made them.

A load's source side (a ``Catalog`` of any registered format) turns DCP read items into
``Request``s; an executor fills them. ``ScatterReads`` (here) reads each file's ranges on
a thread pool, merged into scatter reads straight into the destinations. The two-stage
exchange (``dcp_ext.exchange``) registers itself as ``"two_stage"``: it reads every byte
range once per process group and sends it to the ranks that need it. Storage picks one by
name, so it never imports the exchange package above it. Requests that land off the CPU
go through host staging buffers (``device_staging``) in ``ScatterReads``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter
from typing import Any, Protocol, TypeVar

from dcp_ext.errors import CheckpointError
from dcp_ext.runtime.threads import StartedPool
from dcp_ext.storage.device_staging import STAGING_BUFFER_BYTES, STAGING_BUFFERS, DeviceStaging
from dcp_ext.storage.location import Location
from dcp_ext.storage.read_plan import Request

TASK_BYTES = 32 << 20  # least bytes one thread reads before the next task is picked
# from a local disk: a cold 0.12 GB file read as four 32 MiB stretches took 47.4 ms, as two of 60 MB 43.8
DISK_TASK_BYTES = 64 << 20
SCRATCH_BYTES = 64 << 20  # temporary memory the requests one thread reads at once allocate (or one request's)
LANDED_BYTES = 8 << 20  # bytes of requests with temporaries read before they are completed
SMALL_GAP_BYTES = 4 << 10  # holes this small (record headers) are always read through
GAP_BYTES = 64 << 10  # larger holes only when under 1/32 of the merged read: amplification <= ~3%
DEFAULT_BUDGET_BYTES = 256 << 20  # two-stage: bytes of stored data in flight per batch


@dataclass(frozen=True)
class LoadIdentity:
    """What every member of an exchange group must share: the checkpoint (its canonical
    location and the fingerprint of its metadata)."""

    location: str
    fingerprint: int


@dataclass(frozen=True)
class ReadSettings:
    """What an executor is built from (a ShardReader's options for this load)."""

    location: Location
    thread_count: int
    missing: Callable[[str, str], Exception]  # (file, key) -> the error for a missing data file
    group: Any = None  # two-stage: the exchange's process group (None: the whole job)
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    staging_buffers: int = STAGING_BUFFERS  # loads into device memory: host buffers held at most
    staging_buffer_bytes: int = STAGING_BUFFER_BYTES
    in_memory_thread_count: int = 1  # threads when every byte read is in the page cache (run's in_memory)


class Executor(Protocol):
    seconds: float  # time spent exchanging with other ranks (0 for local reads)
    bytes_received: int  # bytes other ranks sent this one

    collective: bool  # every rank of the group must call run, even one whose planning failed

    def run(
        self,
        requests: Iterable[Request],
        identity: LoadIdentity,
        planning_error: BaseException | None = None,
        expected_bytes: int = 0,
        expected_files: int = 0,
        in_memory: bool = False,
    ) -> tuple[int, set[str]]:
        """Fill every request; returns (bytes read from storage, files opened).

        ``requests`` may be planned as they are taken (a generator, file by file);
        ``expected_bytes`` is about what they add up to and ``expected_files`` how many
        files they read, and ``in_memory`` whether the page cache holds all of it, known
        before (they size tasks and the thread pool; 0 / False: unknown).
        """


EXECUTORS: dict[str, Callable[[ReadSettings], Executor]] = {}


def register_executor(name: str, factory: Callable[[ReadSettings], Executor]) -> None:
    EXECUTORS[name] = factory


class ScatterReads:
    """Requests grouped per file in offset order, spread over a thread pool.

    ``staging`` is the last run's host staging (None when every destination was on the CPU).
    """

    seconds = 0.0
    bytes_received = 0
    collective = False

    def __init__(self, settings: ReadSettings):
        self.settings = settings
        self.staging: DeviceStaging | None = None

    def run(
        self,
        requests: Iterable[Request],
        identity: LoadIdentity,
        planning_error: BaseException | None = None,
        expected_bytes: int = 0,
        expected_files: int = 0,
        in_memory: bool = False,
    ) -> tuple[int, set[str]]:
        """Reads from the page cache wait for nothing but their copy: one thread per core
        then (``in_memory_thread_count``), and with one, the calling thread reads each file
        as it is planned (2 ranks on 2 cores: 48.1 -> 44.3 ms a warm load of 0.54 GB). With
        more, the calling thread is one of them: once every task is handed out, it runs the
        ones no pool thread has started, last first (0.12 GB warm, 8.39 -> 8.25 ms)."""
        if planning_error is not None:
            raise planning_error
        self.staging = None
        threads = self.settings.in_memory_thread_count if in_memory else self.settings.thread_count
        from_disk = not in_memory and self.settings.location.is_local
        limit = task_limit(expected_bytes, threads, DISK_TASK_BYTES if from_disk else TASK_BYTES)
        if expected_files:  # no more threads than there can be tasks (each file's cut at limit)
            threads = max(1, min(threads, expected_files + expected_bytes // limit))
        pool = StartedPool(threads - 1, "dcp_ext-read") if threads > 1 else None
        handed: list[tuple[Future[int], Callable[[list[Request]], int], list[Request]]] = []
        files: set[str] = set()
        total = 0
        try:
            for task in file_tasks(requests, limit):  # each file's reads start while the next is planned
                runner = self._task_runner(task)
                if pool is None:
                    total += runner(task)
                else:
                    handed.append((pool.submit(runner, task), runner, task))
                files.add(task[0].path)
            for future, runner, task in reversed(handed):
                if future.cancel():  # no pool thread took it
                    total += runner(task)
            total += sum(future.result() for future, _, _ in handed if not future.cancelled())
        except BaseException:
            if pool is not None:
                pool.shutdown(cancel_futures=True)  # what has started lands before the error is raised
            raise
        finally:
            if pool is not None:
                pool.shutdown()
            if self.staging is not None:  # every copy has landed (or the load failed) past here
                self.staging.finish()
        return total, files

    def _task_runner(self, task: list[Request]) -> Callable[[list[Request]], int]:
        """How a task runs: straight into host memory, or through host staging when a
        request of it lands off the CPU (the staging starts with the first such task)."""
        devices = {r.device for r in task if r.device is not None}
        if not devices:
            return self._run_task
        if self.staging is None:
            self.staging = DeviceStaging.for_devices(devices, self.settings.staging_buffers, self.settings.staging_buffer_bytes)
        else:
            self.staging.add_devices(devices)
        return self._run_staged_task

    def _run_staged_task(self, task: list[Request]) -> int:
        assert self.staging is not None
        with self.staging.device_work():  # temporaries, copies and completions on the side streams
            return self._run_task(task)

    def _run_task(self, task: list[Request]) -> int:
        path, key = task[0].path, task[0].key
        total = 0
        try:
            with self.settings.location.open_reader(path, key) as reader:
                for batch in scratch_batches(task, SCRATCH_BYTES):  # each completes before the next is read
                    runs = coalesce(batch)
                    total += reader.read_runs(runs) if self.staging is None else self.staging.read(reader, runs)
                    for request in batch:
                        request.complete()
        except FileNotFoundError:
            raise self.settings.missing(path, key) from None
        except OSError as exc:
            raise CheckpointError(f"{self.settings.location.url}: file {path!r} key {key!r}: cannot read ({exc})") from exc
        return total


register_executor("local", ScatterReads)


def task_limit(total_bytes: int, threads: int, least: int = TASK_BYTES) -> int:
    """Bytes per task: a thread's even share of the load (at least ``least``), so each
    thread reads one long stretch of a file. Cold reads run 15-20% faster that way than
    with threads taking turns on neighbouring 32 MiB pieces of the same file, and a load
    from a local disk takes fewer, longer stretches (``DISK_TASK_BYTES``): the kernel reads
    ahead of each stream, and on this virtual disk four streams of ~30 MB took 8% longer
    than two of ~60 (the page cache keeps even shares: a copy waits for nothing)."""
    return max(least, -(-total_bytes // threads))


class FileSpan(Protocol):
    """What a task is cut from: bytes of one file (a ``Request``, a two-stage segment)."""

    @property
    def path(self) -> str: ...

    @property
    def start(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=FileSpan)


def file_tasks(requests: Iterable[S], limit: int) -> Iterator[list[S]]:
    """Tasks of one file's requests in offset order, ``limit`` bytes or a little more each.

    Requests come file by file (as the reader plans them); a file's tasks are made once
    the stream moves past it. A file whose requests come apart is read in separate tasks.
    """
    for _, batch in groupby(requests, key=attrgetter("path")):
        task: list[S] = []
        task_bytes = 0
        for request in sorted(batch, key=attrgetter("start")):
            if task and task_bytes >= limit:
                yield task
                task, task_bytes = [], 0
            task.append(request)
            task_bytes += request.nbytes
        if task:
            yield task


def scratch_batches(task: list[Request], limit: int, landed_bytes: int = LANDED_BYTES) -> Iterator[list[Request]]:
    """The task's requests in order, cut where the temporary memory their targets allocate
    would pass ``limit`` (a request above it goes alone): a task of verified partial reads
    or compressed records allocated every record's buffer before its first read. Also cut
    once the requests with temporaries in a batch read ``landed_bytes``: those have work
    to do once landed (a check, a copy, a layout to parse), which a batch does after its
    last byte, and a whole task's worth of it left the disk idle at the end of a load."""
    batch: list[Request] = []
    held = landed = 0
    for request in task:
        if batch and request.scratch_bytes and (held + request.scratch_bytes > limit or landed >= landed_bytes):
            yield batch
            batch, held, landed = [], 0, 0
        batch.append(request)
        held += request.scratch_bytes
        landed += request.nbytes if request.scratch_bytes else 0
    if batch:
        yield batch


def coalesce(task: list[Request]) -> list[tuple[int, list[Any]]]:
    """Merge the ranges of a task into scatter reads, reading small holes into scratch."""
    runs: list[tuple[int, list[Any]]] = []
    end = -1
    merged = 0  # bytes of the open run: holes under 1/32 of it are read through
    holes = memoryview(bytearray(GAP_BYTES))  # what holes are read into: every one, discarded
    for request in task:
        targets = iter(request.targets())
        for offset, length in request.ranges:
            buffers, filled = [], 0
            while filled < length:
                buffers.append(next(targets))
                filled += buffers[-1].nbytes
            gap = offset - end
            if runs and 0 <= gap <= max(SMALL_GAP_BYTES, min(GAP_BYTES, merged // 32)):
                if gap:
                    runs[-1][1].append(holes[:gap])
                runs[-1][1].extend(buffers)
                merged += gap + length
            else:
                runs.append((offset, buffers))
                merged = length
            end = offset + length
    return runs
