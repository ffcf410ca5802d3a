"""Multi-process test harness: run gloo/CPU jobs and surface worker failures.

``run_job(fn, world_size, *args, timeout=120)`` starts ``world_size`` child
processes with torch.multiprocessing, joins them into one gloo process group,
runs ``fn(rank, world_size, *args)`` on every rank, tears the group down and
returns the list of per-rank return values.  A worker exception fails the
calling test with the failing rank and its full traceback text (other ranks'
tracebacks follow); a job that outlives ``timeout`` seconds is killed and
raises ``TimeoutError``. A job whose gloo group fails to form before any rank runs
``fn`` (a rare loopback flake of gloo's full-mesh setup) is started once more.

Rendezvous: the test process hosts the job's TCPStore on 127.0.0.1 port 0, so
the kernel picks a free port atomically (no pick-then-bind race with other
jobs on the machine); workers get it as MASTER_ADDR/MASTER_PORT and connect.

Start method: ``forkserver`` with torch preloaded by default.  Every worker is
a fresh child of a clean server process that never ran test code (no
inherited process group, threads or test state), but a 4-rank job starts in
under a second instead of ~12 s of ``spawn`` re-importing torch on 2 cores.
Set ``DCP_EXT_MP_START=spawn`` to use plain ``spawn`` (same results, ~6x
slower suite).

``fn`` must be a module-level function (it is pickled by reference), and
``args`` and return values must be picklable.  Assertions inside workers are
not rewritten by pytest, so use ``support.assert_tensor_equal`` /
``assert_state_dict_equal``: they put the names, dtypes, shapes and first
differing element in the message.

A test that starts a job must carry ``@pytest.mark.mp`` (``pytest -m "not mp"``
is the fast layer): ``conftest.py`` tells this module whether the running test
has the mark, and ``run_job`` refuses otherwise.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.multiprocessing.spawn import ProcessException

__all__ = ["run_job", "WorkerError"]

START_METHOD = os.environ.get("DCP_EXT_MP_START", "forkserver")
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch._dynamo",  # imported lazily by the first DTensor op (~2 s per process)
    "fsspec",
]
_preload_set = False


def _start_method() -> str:
    global _preload_set
    if START_METHOD == "forkserver" and not _preload_set:
        import multiprocessing

        # Affects only the forkserver this (test) process starts; a module in
        # the list that fails to import is skipped by multiprocessing.
        multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
        _preload_set = True
    return START_METHOD


MISSING_MP_MARK = "run_job in a test without @pytest.mark.mp: mark it, so `pytest -m \"not mp\"` stays the fast layer"
running_test_has_mp_mark = True  # set by conftest.py before each test; True outside pytest


class WorkerError(AssertionError):
    """A spawned worker raised; the message carries its rank and traceback."""


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    result_dir: str,
    timeout: float,
    args: tuple,
) -> None:
    # Runs in the child.  Any exception escaping here is also reported by
    # torch.multiprocessing; we store the formatted traceback ourselves so the
    # parent can show every failing rank, not only the first one to exit.
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    pg_timeout = datetime.timedelta(seconds=max(5.0, timeout))
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=pg_timeout)
        try:
            dist.init_process_group(
                backend="gloo", store=store, rank=rank, world_size=world_size, timeout=pg_timeout
            )
        except RuntimeError as exc:
            if _GLOO_SETUP_FLAKE in str(exc):
                open(os.path.join(result_dir, f"setup_failed_{rank}"), "w").close()
            raise
        open(os.path.join(result_dir, f"started_{rank}"), "w").close()
        try:
            result = fn(rank, world_size, *args)
        finally:
            # A clean teardown needs no peer; when a peer died the parent
            # kills us anyway, so do not block on a barrier here.
            dist.destroy_process_group()
        with open(os.path.join(result_dir, f"result_{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        text = traceback.format_exc()
        try:
            with open(os.path.join(result_dir, f"error_{rank}.txt"), "w") as f:
                f.write(text)
        except OSError:
            pass
        raise


def _collect_errors(result_dir: str, world_size: int, first: int | None = None) -> str:
    """Worker tracebacks, the first failing rank's first (others are often
    just 'connection closed by peer' fallout from it)."""
    order = list(range(world_size))
    if first is not None and 0 <= first < world_size:
        order.remove(first)
        order.insert(0, first)
    parts = []
    for r in order:
        p = os.path.join(result_dir, f"error_{r}.txt")
        if os.path.exists(p):
            with open(p) as f:
                parts.append(f"--- rank {r} of {world_size} ---\n{f.read()}")
    return "\n".join(parts)


def run_job(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Returns ``[return value of rank 0, rank 1, ...]``. A job whose gloo group could not be
    set up (``_GLOO_SETUP_FLAKE``), before any rank ran ``fn``, is started once more.
    """
    __tracebackhide__ = True
    if not running_test_has_mp_mark:
        raise AssertionError(MISSING_MP_MARK)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        return _run_job_once(fn, world_size, args, timeout)
    except _SetupFlake:
        return _run_job_once(fn, world_size, args, timeout, retry=False)


# gloo's full-mesh setup now and then sees a peer's connection closed on loopback (pytorch
# #53270: "Connection closed by peer [127.0.0.1]" from ProcessGroupGloo's constructor),
# before any rank has run a line of the job
_GLOO_SETUP_FLAKE = "Gloo connectFullMesh failed"


class _SetupFlake(Exception):
    """The job's gloo group failed to form, as ``_GLOO_SETUP_FLAKE`` says, and no rank started ``fn``."""


def _run_job_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, retry: bool = True) -> list:
    __tracebackhide__ = True
    name = getattr(fn, "__qualname__", repr(fn))
    # The rendezvous store lives in this process and binds port 0, so the
    # kernel hands out a free 127.0.0.1 port with no pick-then-bind race
    # against other jobs running concurrently on the machine.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=max(5.0, timeout)),
    )
    result_dir = tempfile.mkdtemp(prefix="dcp_ext_mp_")
    ctx = None
    try:
        ctx = torch_mp.start_processes(
            _worker,
            args=(fn, world_size, store.port, result_dir, timeout, args),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5, grace_period=2.0):
                if time.monotonic() > deadline:
                    _kill_all(ctx)
                    errors = _collect_errors(result_dir, world_size)
                    raise TimeoutError(
                        f"{name} with world_size={world_size} did not finish within {timeout}s"
                        + (f"\nworker errors so far:\n{errors}" if errors else "")
                    )
        except ProcessException as exc:
            names = os.listdir(result_dir)
            if retry and any(n.startswith("setup_failed_") for n in names) and not any(n.startswith("started_") for n in names):
                raise _SetupFlake() from None
            detail = _collect_errors(result_dir, world_size, exc.error_index)
            if f"--- rank {exc.error_index} of" not in detail:
                # Died without a Python exception (signal, os._exit, ...).
                detail = f"{exc}\n{detail}"
            raise WorkerError(
                f"{name} failed (world_size={world_size}, first failing rank {exc.error_index}):\n{detail}"
            ) from None
        results = []
        for r in range(world_size):
            with open(os.path.join(result_dir, f"result_{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        # Never leave workers behind (timeout, Ctrl-C, harness error).
        if ctx is not None:
            _kill_all(ctx)
        shutil.rmtree(result_dir, ignore_errors=True)
        del store


def _kill_all(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(5)
