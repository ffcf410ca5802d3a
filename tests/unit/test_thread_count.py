"""One thread-count rule for reads and writes, and no silently ignored thread_count."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_ext import ShardLoadPlanner, ShardReader, ShardWriter
from dcp_ext.errors import InvalidRequestError
from dcp_ext.runtime.threads import MAX_THREADS, MIN_THREADS, StartedPool, io_thread_count
from dcp_ext.storage import page_cache

from support import assert_state_dict_equal, evict, garbage_like


def test_rule_shares_the_cores_among_the_ranks_of_a_node(monkeypatch) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = io_thread_count()
    assert alone == max(MIN_THREADS, min(MAX_THREADS, 2 * cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))  # more ranks than cores
    assert io_thread_count() == MIN_THREADS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not-a-number")  # a launcher's oddity: counted as one rank
    assert io_thread_count() == alone


def test_reader_and_writer_use_the_rule_and_refuse_bad_counts(tmp_path) -> None:
    assert ShardReader(tmp_path).thread_count == ShardWriter(tmp_path).thread_count == io_thread_count()
    assert ShardReader(tmp_path, thread_count=3).thread_count == 3
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError, match=r"ShardReader\(thread_count=...\) must be a positive integer"):
            ShardReader(tmp_path, thread_count=bad)
        with pytest.raises(InvalidRequestError, match=r"ShardWriter\(thread_count=...\) must be a positive integer"):
            ShardWriter(tmp_path, thread_count=bad)


def _pool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{name}-")]


def test_started_pool_starts_every_thread_before_its_first_task() -> None:
    """A thread started while the others already read waited ~0.9 ms for the GIL on 2 cores
    (ThreadPoolExecutor starts one per submit): all start before any work."""
    pool = StartedPool(3, "test-started")
    try:
        assert len(_pool_threads("test-started")) == 3
        assert [f.result() for f in [pool.submit(pow, 2, n) for n in range(5)]] == [1, 2, 4, 8, 16]
    finally:
        pool.shutdown()
    assert _pool_threads("test-started") == []


def test_started_pool_hands_errors_to_the_waiter_and_cancels_what_has_not_started() -> None:
    gate = threading.Event()
    ran: list[int] = []

    def work(n: int) -> int:
        if n == 0:
            raise ValueError("task 0 failed")
        gate.wait(10)  # task 1 holds the one thread while the consumer stops
        ran.append(n)
        return n

    with StartedPool(1, "test-errors") as pool:
        results = pool.map(work, range(4))
        with pytest.raises(ValueError, match="task 0 failed"):
            next(results)
        results.close()  # the consumer stops: what is still queued is cancelled
        gate.set()
    assert ran == [1]

    with StartedPool(1, "test-cancel") as pool:
        gate.clear()
        started = threading.Event()
        first = pool.submit(lambda: started.set() or gate.wait(10))
        assert started.wait(10)
        queued = [pool.submit(ran.append, n) for n in range(3)]
        threading.Timer(0.2, gate.set).start()
        pool.shutdown(cancel_futures=True)  # waits for the running task only
        assert first.result() is True and all(f.cancelled() for f in queued) and ran == [1]
    pool.shutdown()  # a second shutdown (the with block's) is a no-op


@pytest.mark.mp
def test_a_load_in_an_atexit_handler_reads_its_bytes(tmp_path) -> None:
    """concurrent.futures refuses new work once the interpreter begins to exit; a load run
    from an atexit hook (a script's last export) still reads."""
    script = f"""
import atexit, torch, torch.distributed.checkpoint as dcp
from dcp_ext import ShardLoadPlanner, ShardReader, ShardWriter
path = {str(tmp_path / "ckpt")!r}
want = {{"w": torch.arange(6.0).reshape(2, 3), "b": torch.arange(4, dtype=torch.int64)}}
dcp.save(want, storage_writer=ShardWriter(path), no_dist=True)
def at_exit():
    got = {{"w": torch.full((2, 3), -7.0), "b": torch.full((4,), -7, dtype=torch.int64)}}
    dcp.load(got, storage_reader=ShardReader(path, thread_count=2), planner=ShardLoadPlanner(), no_dist=True)
    assert all(torch.equal(got[k], want[k]) for k in want), got
    print("loaded at exit")
atexit.register(at_exit)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "loaded at exit" in result.stdout, result.stderr[-2000:]


def test_started_pool_shutdown_always_waits_and_refuses_later_work() -> None:
    """A shutdown that another already began (or that an interrupt cut short) still waits
    for the running task: the reader hands the destinations back only after it."""
    gate, second_done = threading.Event(), threading.Event()
    pool = StartedPool(1, "test-rejoin")
    running = pool.submit(gate.wait, 10)
    first = threading.Thread(target=pool.shutdown)
    first.start()
    threading.Thread(target=lambda: (pool.shutdown(), second_done.set())).start()
    assert not second_done.wait(0.3)
    gate.set()
    assert second_done.wait(10) and running.result() is True
    first.join(10)
    with pytest.raises(RuntimeError, match="cannot take work after shutdown"):
        pool.submit(print)


def test_a_load_starts_no_more_reader_threads_than_it_has_tasks(tmp_path) -> None:
    """A pool starts every thread up front, so a load of one small tensor must not start
    thread_count of them (16 on a big node: ~1 ms of starts for one read): its one task is
    read on the calling thread, with no pool at all."""
    want = {"w": torch.arange(12.0).reshape(3, 4)}
    dcp.save(want, storage_writer=ShardWriter(tmp_path), no_dist=True)
    seen: list[int] = []

    class Watching(ShardLoadPlanner):
        def resolve_tensor(self, read_item):  # noqa: ANN001, ANN201 (runs while the pool is up)
            seen.append(len(_pool_threads("dcp_ext-read")))
            return super().resolve_tensor(read_item)

    got = {"w": torch.full((3, 4), -7.0)}
    dcp.load(got, storage_reader=ShardReader(tmp_path, thread_count=8), planner=Watching(), no_dist=True)
    assert torch.equal(got["w"], want["w"]) and seen == [0]


def _files_cached(path) -> bool | None:
    """Whether the page cache holds every data file under ``path`` whole (None: cannot tell)."""
    answers = []
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                answers.append(page_cache.cached(fd, 0, os.fstat(fd).st_size))
            finally:
                os.close(fd)
    return None if None in answers else all(answers)


def test_page_cache_answers_for_a_files_stretch(tmp_path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(os.urandom(1 << 20))
    fd = os.open(target, os.O_RDONLY)
    try:
        if page_cache.cached(fd, 0, 1 << 20) is None:
            pytest.skip("no cachestat(2) here (another OS or architecture, Linux before 6.5, a seccomp filter)")
        os.read(fd, 1 << 20)
        assert page_cache.cached(fd, 0, 1 << 20) is True
        assert page_cache.cached(fd, 5, 5) is True  # nothing to hold
        evict(target)
        if page_cache.cached(fd, 0, 1 << 20):
            pytest.skip("this file system keeps the file's pages (tmpfs)")
        assert page_cache.cached(fd, 0, 4096) is False
        os.pread(fd, 4096, 0)
        assert page_cache.cached(fd, 0, 4096) is True
    finally:
        os.close(fd)


def test_a_load_the_page_cache_holds_reads_on_one_thread_per_core(tmp_path, monkeypatch) -> None:
    """Reads of bytes all in the page cache wait for nothing but their copy: a load starts
    one thread per core the rank can count on (here one: the calling thread reads, no pool),
    and two per core when the bytes must come from the disk (the calling thread and one of
    a pool). Asked with cachestat(2), which reads nothing: a probing read that missed would
    start readahead. Both loads bit-exact into garbage; an explicit thread_count stays what
    it says."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0))))  # one core per rank
    g = torch.Generator().manual_seed(5)
    want = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)}  # 8 MiB in 4 files
    dcp.save(want, storage_writer=ShardWriter(tmp_path, thread_count=4), no_dist=True)
    seen: list[int] = []

    class Watching(ShardLoadPlanner):
        def resolve_tensor(self, read_item):  # noqa: ANN001, ANN201 (runs while the reads are planned)
            seen.append(len(_pool_threads("dcp_ext-read")))
            return super().resolve_tensor(read_item)

    def load(**reader_options) -> list[int]:
        seen.clear()
        got = {k: garbage_like(v) for k, v in want.items()}
        dcp.load(got, storage_reader=ShardReader(tmp_path, **reader_options), planner=Watching(), no_dist=True)
        assert_state_dict_equal(got, want)
        return sorted(set(seen))

    for name in os.listdir(tmp_path):
        (tmp_path / name).read_bytes()  # every file in the page cache
    if _files_cached(tmp_path) is None:
        pytest.skip("no cachestat(2) here: every load reads as from the disk")
    assert load() == [0]  # in memory, one core: the calling thread reads
    assert max(load(thread_count=3)) == 2  # given: the calling thread and two of a pool, however warm
    for name in os.listdir(tmp_path):
        evict(tmp_path / name)
    if _files_cached(tmp_path):
        pytest.skip("this file system keeps the files' pages (tmpfs)")
    assert max(load()) == 1  # from the disk: two threads per core, the calling thread one of them


def test_the_calling_thread_reads_beside_the_pool(tmp_path) -> None:
    """A load on two threads starts one: the calling thread reads the files no pool thread
    has taken once it has handed every file out (seen through Python's audit hooks: each
    read task opens its file; the calling thread first opens each once to ask the page
    cache, so a file it opened twice is one it read)."""
    g = torch.Generator().manual_seed(9)
    want = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(16)}  # 64 MiB in 16 files
    dcp.save(want, storage_writer=ShardWriter(tmp_path, thread_count=16), no_dist=True)
    for name in os.listdir(tmp_path):
        (tmp_path / name).read_bytes()  # every file in the page cache: the probe opens each
    opened: list[tuple[str, str]] = []
    watching = [False]

    def note(event: str, args: tuple) -> None:
        if watching[0] and event == "open" and str(args[0]).endswith(".distcp"):
            opened.append((threading.current_thread().name, str(args[0])))

    sys.addaudithook(note)
    read_by_caller = 0
    try:
        for _ in range(3):
            got = {k: garbage_like(v) for k, v in want.items()}
            opened.clear()
            watching[0] = True
            dcp.load(got, storage_reader=ShardReader(tmp_path, thread_count=2), planner=ShardLoadPlanner(), no_dist=True)
            watching[0] = False
            assert_state_dict_equal(got, want)
            assert {thread for thread, _ in opened} <= {"MainThread", "dcp_ext-read-0"}  # one pool thread
            by_caller = [path for thread, path in opened if thread == "MainThread"]
            read_by_caller += len(by_caller) - len(set(by_caller))
    finally:
        watching[0] = False
    assert read_by_caller > 0


def test_a_long_stretch_is_asked_about_in_windows_that_find_any_uncached_stride(tmp_path, monkeypatch) -> None:
    """``page_cache.held`` asks of a window every STRIDE_BYTES (and at the end), not of
    every page (cachestat walks each page): a file read whole is held, one evicted whole is
    not, and so is not one whose uncached stretch spans a stride, wherever it lies."""
    monkeypatch.setattr(page_cache, "STRIDE_BYTES", 1 << 20)
    monkeypatch.setattr(page_cache, "WINDOW_BYTES", 64 << 10)
    target = tmp_path / "f.bin"
    size = (8 << 20) + 12345
    target.write_bytes(os.urandom(size))
    fd = os.open(target, os.O_RDONLY)
    try:
        if page_cache.cached(fd, 0, size) is None:
            pytest.skip("no cachestat(2) here (another OS or architecture, Linux before 6.5, a seccomp filter)")
        os.read(fd, size)
        assert page_cache.held(fd, 100, size) is True
        evict(target)
        if page_cache.cached(fd, 0, size):
            pytest.skip("this file system keeps the file's pages (tmpfs)")
        assert page_cache.held(fd, 100, size) is False
        for hole in (0, 3 << 20, (5 << 20) + 777, size - (1 << 20)):  # the start, inside, off the windows' grid, the end
            os.pread(fd, size, 0)
            assert page_cache.held(fd, 100, size) is True
            os.posix_fadvise(fd, hole, 1 << 20, os.POSIX_FADV_DONTNEED)
            assert page_cache.held(fd, 100, size) is False, hole
        os.pread(fd, size, 0)
        assert page_cache.held(fd, 50, 60) is True and page_cache.held(fd, 5, 5) is True  # short: asked whole
    finally:
        os.close(fd)
