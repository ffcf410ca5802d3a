"""I/O throughput of stock DCP storage versus ``dcp_ext`` storage, in one run on the same data.

Measures, on a deterministic state dict of mixed tensor sizes (default ~1 GiB):

(a) raw ceilings: sequential write of an equal-sized file with fsync, reads of it with a
    cold and a warm page cache, sequential (the target's ceiling) and by ShardReader's
    thread count in parallel stretches (what the disk gives parallel streams), paired with
    the loads: warm, at the start of every round of loads; cold, just before every cold
    load, as the VM's disk drifts within seconds: each load's ratio is to its own raw
    reads), and memcpy (``Tensor.copy_``);
(b) saves: stock ``FileSystemWriter`` (DCP's default planner) versus ``ShardWriter`` with
    ``ShardSavePlanner`` (checksums and atomic commit on) versus the raw ceiling at equal
    thread counts: the same bytes written by T threads into T files with fsync ("raw"), and
    that plus the CRC32C pass our records need ("raw+crc"; they carry no zip CRC-32, which
    stock's records pay for), all interleaved after one unmeasured round; CPU seconds of
    each; and ``dcp.save``'s own
    floor: a save through a writer that writes nothing (``NoWriteWriter``);
(c) loads into preallocated tensors: stock ``FileSystemReader`` (DCP's default planner) versus
    ``ShardReader`` with ``ShardLoadPlanner`` (the documented pairing), cold
    and warm, each reader on the stock-written AND on the ``ShardWriter``-written checkpoint;
(d) resharded loads with read amplification (bytes read / bytes needed): "split" loads the
    checkpoint saved at P ranks at 2P ranks (every rank needs half of each saved chunk) and
    "merge" loads a checkpoint saved at 2P ranks in one process (whole chunks only).

The state dict goes to DCP as a training job passes it, ``{"model": {name: tensor}}``;
``--state-layout flat`` makes every tensor a top-level key (DCP's per-key ``Stateful``
checks, and on saves its per-key log records, then weigh in every figure: see STATE_LAYOUTS).

With ``--procs N`` the main run uses N gloo processes, each holding a ``Shard(0)`` DTensor
slice of every tensor on a 1-D CPU mesh; with N=1 it runs in this process without a process
group. Throughput is global bytes over the wall time between two barriers, in GB/s (1e9).

Usage::

    python benchmarks/io_throughput.py                  # 1 process, ~1 GiB, 3 repeats
    python benchmarks/io_throughput.py --save-only      # (b) alone, into io_throughput_save.json
    python benchmarks/io_throughput.py --procs 2 --size-gib 0.5 --repeat 5

Cold runs drop the page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``, root only); when
that fails cold figures are reported as unavailable and resharded loads run warm.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import random
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import crc32c
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict  # private: timed, not used
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.runtime.threads import StartedPool, io_thread_count
from cli_args import existing_dir, output_file, positive_float, positive_int

GB = 1e9
COLS = 1024
IO_CHUNK = 64 << 20
POOL_BYTES = 16 << 20
# (label, bytes per tensor, tensors per GiB): 512 + 320 + 128 + 64 MiB = 1 GiB
SIZE_MIX: tuple[tuple[str, int, int], ...] = (
    ("64MiB", 64 << 20, 8),
    ("16MiB", 16 << 20, 20),
    ("1MiB", 1 << 20, 128),
    ("64KiB", 64 << 10, 1024),
)
WRITERS = ("stock", "ours")
SAVE_CEILINGS = ("raw", "raw+crc")  # see raw_save
READERS = ("stock", "ours")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "io_throughput.json"
SAVE_JSON = DEFAULT_JSON.with_name("io_throughput_save.json")  # --save-only
# resharded loads run once: amplification is deterministic and their cold stock loads are slow
RESHARD_REPEAT = 1
# dcp.save/load in one process without a process group warn on every call
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
# How the benchmark hands its tensors to DCP. "nested" is what a training job passes (DCP's
# docs, torchtitan: a handful of top-level keys, {"model": {name: tensor}}); "flat" makes every
# tensor a top-level key, and DCP checks each top-level value for Stateful (and on saves logs
# it), ~20 us (load) and ~50-90 us (save) a key on the 2-core box: a floor no storage layer has
# to pay for a real job's state dict, and that stock and ours pay alike.
STATE_LAYOUTS = ("nested", "flat")
MODEL_KEY = "model"
TARGETS = {"save": 1.0, "save_ceiling": 0.9, "cold": 0.85, "warm": 0.6, "amplification": 1.05}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the benchmark state dict: a (rows, COLS) matrix."""

    name: str
    rows: int
    dtype: torch.dtype
    pool_offset: int

    @property
    def nbytes(self) -> int:
        return self.rows * COLS * self.dtype.itemsize


@dataclass(frozen=True)
class Config:
    """Everything a phase needs; picklable so spawned workers receive it."""

    specs: tuple[TensorSpec, ...]
    workdir: Path
    threads: tuple[int, ...]
    repeat: int
    procs: int
    layout: str = "nested"  # see STATE_LAYOUTS
    same_dir: bool = False  # saves go into one directory per kind again and again (--same-dir)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def ckpt(self, name: str) -> Path:
        return self.workdir / name

    def passed(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The state dict as ``dcp.save``/``dcp.load`` are given it (``layout``)."""
        return {MODEL_KEY: state} if self.layout == "nested" else state


@dataclass(frozen=True)
class Group:
    """This process's place in the run: a gloo group with a 1-D mesh, or a lone process."""

    rank: int
    world: int
    mesh: DeviceMesh | None

    @property
    def no_dist(self) -> bool:
        return self.world == 1

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


@dataclass(frozen=True)
class LoadSample:
    """One timed load: seconds, and bytes read summed over ranks."""

    seconds: float
    bytes_read: int
    rchar: int


class CountingFileSystemReader(dcp.FileSystemReader):
    """Stock reader that records what it reads: the whole stored record of every ReadItem."""

    record_bytes = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        self.record_bytes = sum(self.storage_data[i.storage_index].length for i in plan.items)
        return super().read_data(plan, planner)


class NoReadReader(ShardReader):
    """ShardReader whose ``read_data`` reads nothing: what ``dcp.load`` costs before and
    after any storage read (its set-up, the planner, the collectives)."""

    def _takes_columns(self) -> bool:
        # as ShardReader itself answers (ShardReader reads columns where the checkpoint has no
        # TP-replica copies); the default answer for a subclass with its own read_data is no,
        # and ShardLoadPlanner would then build a ReadItem for each piece (590 at 2 processes:
        # ~1.5 ms) that no load of ours builds
        return not self._require_catalog().copies

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


class NoWriteWriter(ShardWriter):
    """ShardWriter whose ``write_data`` writes nothing and whose ``finish`` commits nothing:
    what ``dcp.save`` costs before and after any storage write (its set-up, the planner,
    the collectives)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result([])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass


# ----------------------------------------------------------------------------- data


def build_specs(size_gib: float) -> tuple[TensorSpec, ...]:
    """The deterministic tensor list: SIZE_MIX scaled to ``size_gib``, fp32/bf16 alternating."""
    specs = []
    for label, nbytes, per_gib in SIZE_MIX:
        for i in range(max(1, round(per_gib * size_gib))):
            dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
            rows = nbytes // (COLS * dtype.itemsize)
            name = f"{label}.{i}.{'fp32' if dtype == torch.float32 else 'bf16'}"
            specs.append(TensorSpec(name, rows, dtype, len(specs) * 1_000_003))
    random.Random(0).shuffle(specs)
    return tuple(specs)


_POOLS: dict[torch.dtype, torch.Tensor] = {}


def pool(dtype: torch.dtype) -> torch.Tensor:
    """A fixed random 1-D tensor that all tensor contents are cut from (fast, deterministic)."""
    if dtype not in _POOLS:
        base = torch.randn(POOL_BYTES // 4, generator=torch.Generator().manual_seed(1234))
        _POOLS[dtype] = base.to(dtype)
    return _POOLS[dtype]


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of a Shard(0) placement held by ``rank`` (torch.chunk semantics)."""
    step = -(-rows // world)
    start = min(rows, rank * step)
    return start, min(rows, start + step)


def fill_rows(spec: TensorSpec, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the global tensor; element j is pool[(pool_offset + j) % len]."""
    src = pool(spec.dtype)
    out = torch.empty((stop - start, COLS), dtype=spec.dtype)
    flat = out.view(-1)
    pos, at = 0, (spec.pool_offset + start * COLS) % src.numel()
    while pos < flat.numel():
        n = min(src.numel() - at, flat.numel() - pos)
        flat[pos : pos + n].copy_(src[at : at + n])
        pos, at = pos + n, (at + n) % src.numel()
    return out


def make_state(cfg: Config, group: Group, filled: bool) -> dict[str, torch.Tensor]:
    """The rank's state dict: plain tensors alone, Shard(0) DTensors in a group.

    ``filled=False`` gives zeroed destinations (pages already faulted in).
    """
    state: dict[str, torch.Tensor] = {}
    for spec in cfg.specs:
        start, stop = row_range(spec.rows, group.world, group.rank)
        local = fill_rows(spec, start, stop) if filled else torch.zeros((stop - start, COLS), dtype=spec.dtype)
        if group.world == 1:
            state[spec.name] = local
        else:
            state[spec.name] = DTensor.from_local(
                local, group.mesh, [Shard(0)], run_check=False, shape=torch.Size((spec.rows, COLS)), stride=(COLS, 1)
            )
    return state


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a tensor or DTensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def zero_(state: dict[str, torch.Tensor]) -> None:
    """Zero every rank-local tensor of ``state`` in place."""
    for t in state.values():
        local_view(t).zero_()


def verify(group: Group, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """True when every rank's loaded data equals the expected data exactly."""
    ok = all(torch.equal(local_view(got[k]), local_view(want[k])) for k in want)
    return all(group.gather(ok))


# ----------------------------------------------------------------------------- measuring


def drop_caches(group: Group) -> bool:
    """Drop the page cache (rank 0 does it for the host); False when not permitted."""
    group.barrier()
    ok = None
    if group.rank == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            ok = True
        except OSError:
            ok = False
    return bool(group.gather(ok)[0])


def timed(group: Group, fn: Callable[[], object]) -> float:
    """Wall seconds of ``fn`` on all ranks, between two barriers, with the cyclic garbage
    collector off, as ``timeit`` times: a full collection (~120 ms in this process)
    otherwise lands in whichever sample crosses CPython's threshold, and stock's loads
    cross it every ~2.5 loads. (Collecting before each sample instead left the CPU caches
    cold: a 0.12 GB load took 1.9 ms longer.) benchmarks/gc_pauses.py measures what each
    path's own allocations cost in collections."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        group.barrier()
        start = time.perf_counter()
        fn()
        group.barrier()
        return time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()


def proc_rchar() -> int:
    """Bytes this process has read through read syscalls (page-cache hits included)."""
    return _proc_io("rchar")


def proc_read_bytes() -> int:
    """Bytes this process made the kernel fetch from storage (mmap page faults included)."""
    return _proc_io("read_bytes")


def _proc_io(field: str) -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/io")


def summary(seconds: list[float], nbytes: int) -> dict[str, Any]:
    """Median and best throughput of repeated timings."""
    med = statistics.median(seconds)
    return {
        "seconds": seconds,
        "median_s": med,
        "gbps": nbytes / med / GB,
        "best_gbps": nbytes / min(seconds) / GB,
    }


def per_pair(base_s: list[float], seconds: list[float]) -> float | None:
    """Throughput over the base's, pair by pair: the median of base seconds / seconds
    (None without pairs). The two of a pair are timed close together, so the drift of this
    machine's disk and memory falls on both."""
    return statistics.median(b / t for b, t in zip(base_s, seconds)) if base_s and seconds else None


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing."""
    return None if num is None or not den else num / den


def warm_cache(group: Group, path: Path) -> None:
    """Read every file under ``path`` once so that it sits in the page cache."""
    if group.rank == 0:
        buf = bytearray(IO_CHUNK)
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            with open(file, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    group.barrier()


def write_file(path: Path, nbytes: int) -> None:
    """Write ``nbytes`` of random bytes sequentially, then fsync."""
    src = memoryview(pool(torch.float32).view(torch.uint8).numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, src[: min(len(src), nbytes - done)])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: Path, dst: memoryview, pool: StartedPool | None = None, stretches: int = 1) -> None:
    """Read the file into ``dst``: sequentially, or (with ``pool``) as ``stretches``
    contiguous stretches read at once, one file descriptor each."""
    step = -(-len(dst) // stretches) if pool is not None else len(dst)

    def stretch(start: int) -> None:
        end = min(len(dst), start + step)
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            pos = start
            while pos < end:
                n = f.readinto(dst[pos : min(end, pos + IO_CHUNK)])
                if not n:
                    raise EOFError(f"{path}: short read at {pos}")
                pos += n

    if pool is None:
        stretch(0)
    else:
        list(pool.map(stretch, range(0, len(dst), max(1, step))))


class RawRead:
    """The raw read ceilings: this rank's share of bytes in one file, read into one buffer
    sequentially (the issue's ceiling) and by as many threads as ``ShardReader`` starts,
    each a stretch of the file (what the disk gives parallel streams). The file stays on
    disk while the loads run, so that they are read in the loads' cache state beside them
    (the disk and memory of a VM drift over a run)."""

    def __init__(self, cfg: Config, group: Group, nbytes: int):
        self.path = cfg.workdir / f"raw_r{group.rank}.bin"
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.group = group
        self.threads = io_thread_count()
        self.pool = StartedPool(self.threads, "raw-read")  # its threads start before the first timed read

    def write(self) -> float:
        self.path.unlink(missing_ok=True)
        drop_caches(self.group)
        return timed(self.group, lambda: write_file(self.path, self.buffer.numel()))

    def read(self, cold: bool, parallel: bool = False) -> float:
        dst = memoryview(self.buffer.numpy())
        if cold:
            drop_caches(self.group)
        else:
            read_file(self.path, dst)  # warm: in the page cache
        return timed(self.group, lambda: read_file(self.path, dst, self.pool if parallel else None, self.threads))

    def remove(self) -> None:
        self.pool.shutdown()
        self.path.unlink(missing_ok=True)


def measure_ceilings(cfg: Config, raw: RawRead) -> dict[str, Any]:
    """Raw write+fsync and memcpy of the rank's share of bytes (the reads: ``measure_loads``)."""
    write_s = [raw.write() for _ in range(cfg.repeat)]
    copy_dst = torch.zeros_like(raw.buffer)
    copy_s = [timed(raw.group, lambda: copy_dst.copy_(raw.buffer)) for _ in range(cfg.repeat)]
    return {"write_fsync": summary(write_s, cfg.total_bytes), "memcpy": summary(copy_s, cfg.total_bytes)}


def make_writer(kind: str, path: Path, threads: int) -> StorageWriter:
    """Stock FileSystemWriter or ShardWriter (checksums on), both fsyncing their files."""
    if kind == "stock":
        return dcp.FileSystemWriter(path, thread_count=threads, sync_files=True)
    return ShardWriter(path, thread_count=threads, sync_files=True, checksums=True)


def make_reader(kind: str, path: Path) -> StorageReader:
    """Counting stock reader or ShardReader without the metadata cache (cold means cold)."""
    if kind == "stock":
        return CountingFileSystemReader(path)
    return ShardReader(path, cache_metadata=False)


def make_planner(kind: str) -> LoadPlanner | None:
    """Each reader with its documented planner: DCP's default for stock, ShardLoadPlanner for ours."""
    return None if kind == "stock" else ShardLoadPlanner()


def make_save_planner(kind: str) -> SavePlanner | None:
    """Each writer with its documented planner: DCP's default for stock, ShardSavePlanner for ours."""
    return None if kind == "stock" else ShardSavePlanner()


def reader_bytes(reader: StorageReader) -> int:
    """Data bytes the reader read during its last load on this rank."""
    if isinstance(reader, CountingFileSystemReader):
        return reader.record_bytes
    return reader.stats.bytes_read


def save_once(cfg: Config, group: Group, kind: str, threads: int, path: Path, state: dict[str, torch.Tensor]) -> float:
    """Seconds of one save into a fresh directory, starting with no dirty pages."""
    return save_sample(cfg, group, kind, threads, path, state)[0]


# ----------------------------------------------------------------------------- saves


def balanced_buckets(tensors: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """The tensors in ``n`` bins of near-equal bytes, largest first (as the writers balance files)."""
    buckets: list[list[torch.Tensor]] = [[] for _ in range(max(1, min(n, len(tensors))))]
    loads = [0] * len(buckets)
    for t in sorted(tensors, key=lambda t: t.nbytes, reverse=True):
        lightest = loads.index(min(loads))
        buckets[lightest].append(t)
        loads[lightest] += t.nbytes
    return buckets


def raw_write(path: Path, tensors: list[torch.Tensor], checksums: bool) -> None:
    """Write the tensors' bytes back to back into one file, then fsync; with ``checksums``
    also run the CRC32C a record of ours costs over every byte, the CPU a checksummed save
    cannot avoid."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            if checksums:
                crc32c.crc32c(view)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_save(path: Path, buckets: list[list[torch.Tensor]], checksums: bool) -> None:
    """The ceiling of a save at ``len(buckets)`` threads: each thread writes one bucket
    sequentially into its own file and fsyncs it."""
    path.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=len(buckets)) as pool:
        list(pool.map(lambda n: raw_write(path / f"raw_{os.getpid()}_{n}.bin", buckets[n], checksums),
                      range(len(buckets))))


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def save_sample(cfg: Config, group: Group, kind: str, threads: int, path: Path, state: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(wall seconds, CPU seconds summed over ranks) of one save of ``kind`` into a fresh
    directory (``cfg.same_dir``: into the one it saved into last, over that save's files),
    starting with no dirty pages: a dcp.save through a writer or a raw write."""
    if group.rank == 0 and path.exists() and not cfg.same_dir:
        shutil.rmtree(path)
    drop_caches(group)  # outside the CPU count: dropping the cache is charged to this process
    if kind in SAVE_CEILINGS:
        buckets = balanced_buckets([local_view(t) for t in state.values()], threads)
        run = lambda: raw_save(path, buckets, checksums=kind == "raw+crc")  # noqa: E731
    else:
        writer = make_writer(kind, path, threads)
        planner = make_save_planner(kind)
        run = lambda: dcp.save(cfg.passed(state), storage_writer=writer, planner=planner, no_dist=group.no_dist)  # noqa: E731
    before = cpu_seconds()
    seconds = timed(group, run)
    return seconds, sum(group.gather(cpu_seconds() - before))


def measure_saves(cfg: Config, group: Group, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Raw write ceilings, stock and ours at each thread count, interleaved (every other
    round in reverse order), ``cfg.repeat`` times; leaves ckpt_stock and ckpt_ours written
    with the last thread count. Each ratio is the median over rounds of the ratio within a
    round (``per_pair``): a save's fsyncs wait for this machine's disk, whose write speed
    moves between rounds (stock's 1.07 GB save took 0.91, 0.92 and 2.2 s in one run)."""
    out: dict[str, Any] = {}
    kinds = (*SAVE_CEILINGS, *WRITERS)
    for threads in cfg.threads:
        samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
        # an unmeasured round first: the first saves after the state is built ran 1.5-3x
        # slower, their writes held to the disk's speed after the first ~40 MB (8 MiB writes
        # of ~16 ms instead of ~2; a 3 s pause, or any earlier save, left them fast), and
        # with --same-dir each measured save then replaces one
        for kind in kinds:
            save_sample(cfg, group, kind, threads, cfg.ckpt(f"ckpt_{kind}"), state)
        for rep in range(cfg.repeat):
            for kind in kinds[:: -1 if rep % 2 else 1]:
                samples[kind].append(save_sample(cfg, group, kind, threads, cfg.ckpt(f"ckpt_{kind}"), state))
        row: dict[str, Any] = {}
        for kind, runs in samples.items():
            row[kind] = summary([wall for wall, _ in runs], cfg.total_bytes) | {
                "cpu_s": statistics.median(cpu for _, cpu in runs)}

        wall = {kind: [w for w, _ in runs] for kind, runs in samples.items()}
        row["ours/raw"] = per_pair(wall["raw"], wall["ours"])
        row["stock/raw"] = per_pair(wall["raw"], wall["stock"])
        row["ours/raw+crc"] = per_pair(wall["raw+crc"], wall["ours"])
        row["ours/stock"] = per_pair(wall["stock"], wall["ours"])
        out[str(threads)] = row
    shutil.rmtree(cfg.ckpt("ckpt_raw"), ignore_errors=True)
    shutil.rmtree(cfg.ckpt("ckpt_raw+crc"), ignore_errors=True)
    return out


def phase_save(cfg: Config, group: Group) -> dict[str, Any]:
    """The save section alone (``--save-only``)."""
    return {"cold_available": drop_caches(group), "save": measure_saves(cfg, group, make_state(cfg, group, filled=True))}


def report_saves(saves: dict[str, Any], check: Callable[[str, float | None, float], str]) -> None:
    """Print the save table: ours against the raw ceilings and stock at each thread count."""
    rows = []
    for threads, row in saves.items():
        rows.append(
            [f"T={threads}", *(fmt(row[kind]["gbps"]) for kind in (*SAVE_CEILINGS, *WRITERS)),
             fmt(row["stock/raw"]), fmt(row["ours/raw"]), fmt(row["ours/raw+crc"]), fmt(row["ours/stock"]),
             f">={TARGETS['save_ceiling']} {check(f'save T={threads} ours/raw', row['ours/raw'], TARGETS['save_ceiling'])}",
             f">={TARGETS['save']} {check(f'save T={threads} ours/stock', row['ours/stock'], TARGETS['save'])}",
             " / ".join(fmt(row[kind]["cpu_s"]) for kind in (*SAVE_CEILINGS, *WRITERS))]
        )
    print_table(
        "Save, GB/s (fsync on; ours with CRC32C and atomic commit; raw = the same bytes written by T threads "
        "into T files + fsync; raw+crc = raw plus the CRC32C pass the records need; a/b = median over rounds "
        "of b's seconds / a's seconds in the round)",
        ["threads", "raw", "raw+crc", "stock", "ours", "stock/raw", "ours/raw", "ours/raw+crc", "ours/stock",
         "target", "target", "CPU s raw / raw+crc / stock / ours"],
        rows,
    )


def load_once(cfg: Config, group: Group, kind: str, path: Path, dst: dict[str, torch.Tensor], cold: bool) -> LoadSample:
    """One timed load of ``path`` into ``dst`` with a fresh reader."""
    reader = make_reader(kind, path)
    if cold:
        drop_caches(group)
    before = proc_rchar()
    seconds = timed(group, lambda: dcp.load(cfg.passed(dst), storage_reader=reader, planner=make_planner(kind),
                                            no_dist=group.no_dist))
    counts = group.gather((reader_bytes(reader), proc_rchar() - before))
    return LoadSample(seconds, sum(c[0] for c in counts), sum(c[1] for c in counts))


def measure_loads(
    cfg: Config,
    group: Group,
    ckpts: dict[str, Path],
    modes: tuple[str, ...],
    dst: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    repeat: int,
    raw: RawRead | None = None,
) -> dict[str, Any]:
    """Both readers on each checkpoint in each mode ("cold"/"warm"), ``repeat`` times,
    interleaved (every other round in reverse order). With ``raw``, each load is paired
    with raw reads (sequential and parallel) in its cache state, and each reader's
    ``x_raw`` / ``x_raw_parallel`` is the median of the per-load ratios (raw seconds / load
    seconds): warm, the raw reads at the start of the round (the page cache and memory hold
    still over a round); cold, raw reads just before each load, because this machine's disk
    does not: one 1.07 GB raw cold read took 0.30 s in one round and 1.26 s in another, and
    over one round of four loads it moved too. All raw reads go to ``[mode]["raw"]`` and
    ``[mode]["raw_parallel"]``. Cold loads follow one unmeasured round of them.

    The first repeat of each case loads into zeroed tensors and is verified.
    """
    needed = sum(group.gather(sum(local_view(t).nbytes for t in dst.values())))
    out: dict[str, Any] = {}
    for mode in modes:
        cold = mode == "cold"
        if not cold:
            for path in ckpts.values():
                warm_cache(group, path)
        samples: dict[tuple[str, str], list[LoadSample]] = {(c, k): [] for c in ckpts for k in READERS}
        paired: dict[tuple[str, str], list[tuple[float, float]]] = {case: [] for case in samples}  # each load's raw reads
        raw_s: list[tuple[float, float]] = []  # (sequential, parallel)
        verified: dict[tuple[str, str], bool] = {}
        # cold, an unmeasured round first: this VM's disk reads slowest in the seconds after
        # the saves that wrote the checkpoints (a fresh 0.12 GB checkpoint's first cold loads:
        # 142 and 88 ms, then 41-48; raw reads there spike to 77-152 too)
        for label, kind in samples if cold else ():
            if raw is not None:
                raw.read(cold=True)
                raw.read(cold=True, parallel=True)
            load_once(cfg, group, kind, ckpts[label], dst, cold=True)
        for rep in range(repeat):
            if raw is not None and not cold:
                raw_s.append((raw.read(cold=False), raw.read(cold=False, parallel=True)))
            # every other round in reverse: a load right after another reader's runs with the CPU
            # caches that one left (0.12 GB: 3 ms slower after a stock load), so each reader takes both places
            for (label, kind), runs in list(samples.items())[:: -1 if rep % 2 else 1]:
                if raw is not None:
                    if cold:
                        raw_s.append((raw.read(cold=True), raw.read(cold=True, parallel=True)))
                    paired[label, kind].append(raw_s[-1])
                if rep == 0:
                    zero_(dst)
                runs.append(load_once(cfg, group, kind, ckpts[label], dst, cold=cold))
                if rep == 0:
                    verified[label, kind] = verify(group, dst, want)
        out[mode] = {"raw": summary([r[0] for r in raw_s], cfg.total_bytes),
                     "raw_parallel": summary([r[1] for r in raw_s], cfg.total_bytes) | {"threads": raw.threads}
                     } if raw is not None else {}
        for label in ckpts:
            row: dict[str, Any] = {}
            for kind in READERS:
                runs = samples[label, kind]
                seconds = [r.seconds for r in runs]
                row[kind] = summary(seconds, needed) | {
                    "x_raw": per_pair([r[0] for r in paired[label, kind]], seconds),
                    "x_raw_parallel": per_pair([r[1] for r in paired[label, kind]], seconds),
                    "bytes_needed": needed,
                    "bytes_read": runs[0].bytes_read,
                    "read_amplification": runs[0].bytes_read / needed,
                    "rchar": runs[0].rchar,
                    "rchar_amplification": runs[0].rchar / needed,
                    "verified": verified[label, kind],
                }
            row["ours/stock"] = per_pair([r.seconds for r in samples[label, "stock"]], [r.seconds for r in samples[label, "ours"]])
            out[mode][label] = row
    return out


def measure_floor(cfg: Config, group: Group, path: Path, dst: dict[str, torch.Tensor], repeat: int) -> dict[str, Any]:
    """Seconds of ``dcp.load`` with no storage reads, with DCP's default planner and with
    ShardLoadPlanner (whose local plan is in it): no reader can load faster than this plus
    its reads, unless it overlaps them with DCP's own work. The metadata is cached there;
    ``ours_metadata_read`` reads and decodes it at every load, as the loads measured above
    do (``make_reader``: a fresh process's first load). In a process group also
    ShardLoadPlanner with ``no_dist=True`` (``ours_no_exchange``): the same steps without
    DCP's plan exchange and closing all-gather, which is what they cost."""
    NoReadReader(path).read_metadata()  # cached: the floor holds no metadata read
    variants = [("default", lambda: None, group.no_dist, True), ("ours", ShardLoadPlanner, group.no_dist, True),
                ("ours_metadata_read", ShardLoadPlanner, group.no_dist, False)]
    if not group.no_dist:
        variants.append(("ours_no_exchange", ShardLoadPlanner, True, True))
    return {label: warm_samples(group, lambda: dcp.load(cfg.passed(dst), storage_reader=NoReadReader(path, cache_metadata=cached),
                                                        planner=planner(), no_dist=no_dist), repeat)
            for label, planner, no_dist, cached in variants}


def warm_samples(group: Group, fn: Callable[[], object], repeat: int) -> dict[str, Any]:
    """``repeat`` timings of ``fn`` after two warm-ups (first-call costs are not a floor)."""
    seconds = [timed(group, fn) for _ in range(repeat + 2)][2:]
    return {"seconds": seconds, "median_s": statistics.median(seconds)}


def measure_save_floor(cfg: Config, group: Group, path: Path, state: dict[str, torch.Tensor], repeat: int) -> dict[str, Any]:
    """Seconds of ``dcp.save`` with no storage writes, with DCP's default planner and with
    ShardSavePlanner, and of the part of it that is DCP's per-key ``Stateful`` check (in
    torch 2.13 each key's check is wrapped in DCP's method logger, which builds two debug
    log records for a ``NullHandler``): no writer can save faster than this plus its writes."""
    out = {label: warm_samples(group, lambda: dcp.save(cfg.passed(state), storage_writer=NoWriteWriter(path), planner=planner(),
                                                       no_dist=group.no_dist), repeat)
           for label, planner in (("default", lambda: None), ("ours", ShardSavePlanner))}
    out["stateful_check"] = warm_samples(group, lambda: _stateful_to_state_dict(cfg.passed(state)), repeat)
    shutil.rmtree(path, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- phases


def measure_compression(cfg: Config, group: Group, state: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> dict[str, Any]:
    """ShardWriter(compression="zstd") against the plain ShardWriter checkpoint just saved:
    stored size, save throughput, warm load throughput (same thread count, fsync on)."""
    threads, path = max(cfg.threads), cfg.ckpt("ckpt_zstd")
    save_s, load_s = [], []
    for _ in range(cfg.repeat):
        if group.rank == 0 and path.exists():
            shutil.rmtree(path)
        drop_caches(group)
        writer = ShardWriter(path, thread_count=threads, sync_files=True, compression="zstd")
        save_s.append(timed(group, lambda: dcp.save(cfg.passed(state), storage_writer=writer, planner=make_save_planner("ours"),
                                                     no_dist=group.no_dist)))
    warm_cache(group, path)
    for _ in range(cfg.repeat):
        reader = ShardReader(path, cache_metadata=False)
        load_s.append(timed(group, lambda: dcp.load(cfg.passed(dst), storage_reader=reader, planner=make_planner("ours"),
                                                     no_dist=group.no_dist)))

    def stored(directory: Path) -> int:
        return sum(f.stat().st_size for f in directory.glob("*.distcp"))

    return {"threads": threads, "stored_bytes": stored(path), "plain_stored_bytes": stored(cfg.ckpt("ckpt_ours")),
            "save": summary(save_s, cfg.total_bytes), "load_warm": summary(load_s, cfg.total_bytes),
            "verified": verify(group, dst, state)}


def phase_main(cfg: Config, group: Group) -> dict[str, Any]:
    """(a) ceilings, (b) saves and (c) loads at ``cfg.procs`` ranks, (d) zstd's trade-off."""
    state = make_state(cfg, group, filled=True)
    local_bytes = sum(local_view(t).nbytes for t in state.values())
    cold_ok = drop_caches(group)
    raw = RawRead(cfg, group, local_bytes)
    ckpts = {"stock-written": cfg.ckpt("ckpt_stock"), "ours-written": cfg.ckpt("ckpt_ours")}
    modes = ("cold", "warm") if cold_ok else ("warm",)
    try:
        ceilings = measure_ceilings(cfg, raw)
        saves = measure_saves(cfg, group, state)
        loads = measure_loads(cfg, group, ckpts, modes, make_state(cfg, group, filled=False), state, cfg.repeat, raw)
    finally:
        raw.remove()
    ceilings["read_cold"] = loads["cold"].pop("raw") if cold_ok else None
    ceilings["read_cold_parallel"] = loads["cold"].pop("raw_parallel") if cold_ok else None
    ceilings["read_warm"] = loads["warm"].pop("raw")
    ceilings["read_warm_parallel"] = loads["warm"].pop("raw_parallel")
    floor = measure_floor(cfg, group, ckpts["ours-written"], make_state(cfg, group, filled=False), max(cfg.repeat, 5))
    save_floor = measure_save_floor(cfg, group, cfg.ckpt("ckpt_no_write"), state, max(cfg.repeat, 5))
    compression = measure_compression(cfg, group, state, make_state(cfg, group, filled=False))
    return {"cold_available": cold_ok, "ceilings": ceilings, "save": saves, "load": loads, "load_floor": floor,
            "save_floor": save_floor,
            "compression": compression}


def phase_split(cfg: Config, group: Group) -> dict[str, Any]:
    """Load the P-rank checkpoints at 2P ranks, then save a 2P-rank checkpoint for "merge"."""
    want = make_state(cfg, group, filled=True)
    modes = ("cold",) if drop_caches(group) else ("warm",)
    ckpts = {"stock-written": cfg.ckpt("ckpt_stock"), "ours-written": cfg.ckpt("ckpt_ours")}
    loads = measure_loads(cfg, group, ckpts, modes, make_state(cfg, group, filled=False), want, RESHARD_REPEAT)
    save_once(cfg, group, "ours", cfg.threads[-1], cfg.ckpt(f"ckpt_ours_w{group.world}"), want)
    return {"saved_ranks": cfg.procs, "loaded_ranks": group.world, "mode": modes[0], "load": loads[modes[0]]}


def phase_merge(cfg: Config, group: Group) -> dict[str, Any]:
    """Load the 2P-rank checkpoint in one process (whole chunks only)."""
    want = make_state(cfg, group, filled=True)
    modes = ("cold",) if drop_caches(group) else ("warm",)
    ckpts = {"ours-written": cfg.ckpt(f"ckpt_ours_w{2 * cfg.procs}")}
    loads = measure_loads(cfg, group, ckpts, modes, make_state(cfg, group, filled=False), want, RESHARD_REPEAT)
    return {"saved_ranks": 2 * cfg.procs, "loaded_ranks": 1, "mode": modes[0], "load": loads[modes[0]]}


PHASES: dict[str, Callable[[Config, Group], dict[str, Any]]] = {
    "main": phase_main,
    "split": phase_split,
    "merge": phase_merge,
    "save": phase_save,
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, world: int, port: int, torch_threads: int = 1) -> None:
    """Join a gloo group of ``world`` spawned processes on this host, with the environment
    torchrun gives each rank: ``LOCAL_WORLD_SIZE`` sets how many I/O threads a reader or
    writer starts (the cores shared among the ranks on the node), so a benchmark's ranks
    run as many as a user's do."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(torch_threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _worker(rank: int, world: int, port: int, phase: str, cfg: Config, out: str) -> None:
    """Entry point of a spawned rank: join the gloo group, run the phase, rank 0 writes JSON."""
    join_gloo(rank, world, port, max(1, (os.cpu_count() or 1) // world))
    try:
        result = PHASES[phase](cfg, Group(rank, world, init_device_mesh("cpu", (world,))))
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_phase(phase: str, world: int, cfg: Config) -> dict[str, Any]:
    """Run a phase in this process (world 1) or in ``world`` spawned gloo processes."""
    print(f"[io_throughput] phase {phase} at {world} process(es)", file=sys.stderr, flush=True)
    if world == 1:
        return PHASES[phase](cfg, Group(0, 1, None))
    out = cfg.workdir / f"result_{phase}.json"
    mp.spawn(_worker, args=(world, free_port(), phase, cfg, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- report


def fmt(x: float | None, spec: str = ".2f") -> str:
    """Format a number for the tables, n/a when missing."""
    return "n/a" if x is None else format(x, spec)


def verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    """PASS/FAIL against a target, n/a when the value is missing."""
    if value is None:
        return "n/a"
    return "PASS" if (value >= target if higher_is_better else value <= target) else "FAIL"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Print a column-aligned table: first column left, the others right."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def checker(checks: list[dict[str, Any]]) -> Callable[..., str]:
    """A function that judges a value against its target and records the check in ``checks``."""

    def check(name: str, value: float | None, target: float, higher: bool = True) -> str:
        v = verdict(value, target, higher)
        checks.append({"name": name, "value": value, "target": target, "result": v})
        return v

    return check


def report_floor(main: dict[str, Any]) -> None:
    """The warm load beside what dcp.load costs with no reads plus the raw read."""
    raw_s = main["ceilings"]["read_warm"]["median_s"]
    ours_s = main["load"]["warm"]["ours-written"]["ours"]["median_s"]
    rows = []
    for label, planner in (("default", "DefaultLoadPlanner"), ("ours", "ShardLoadPlanner"),
                           ("ours_metadata_read", "ShardLoadPlanner, metadata read (as the loads)"),
                           ("ours_no_exchange", "ShardLoadPlanner, no_dist=True")):
        if label not in main["load_floor"]:  # one process: no exchange to leave out (older JSON: no metadata read)
            continue
        floor_s = main["load_floor"][label]["median_s"]
        rows.append([planner, fmt(floor_s * 1e3, ".1f"), fmt(raw_s * 1e3, ".1f"), fmt((floor_s + raw_s) * 1e3, ".1f"),
                     fmt(ours_s * 1e3, ".1f"), fmt(ratio(floor_s + raw_s, ours_s))])
    print_table("Warm load against dcp.load's own cost: dcp.load with no storage reads (metadata cached unless said) + the raw read",
                ["planner", "no-read load ms", "raw read ms", "sum ms", "ours warm ms", "sum / ours"], rows)


def report_save_floor(main: dict[str, Any]) -> None:
    """Each thread count's save beside what dcp.save costs with no writes plus the raw write."""
    floor = main["save_floor"]
    rows = []
    for threads, row in main["save"].items():
        raw_s, ours_s = row["raw"]["median_s"], row["ours"]["median_s"]
        for label, planner in (("default", "DefaultSavePlanner"), ("ours", "ShardSavePlanner")):
            floor_s = floor[label]["median_s"]
            rows.append([f"T={threads}", planner, fmt(floor_s * 1e3, ".1f"), fmt(raw_s * 1e3, ".1f"),
                         fmt((floor_s + raw_s) * 1e3, ".1f"), fmt(ours_s * 1e3, ".1f"), fmt(ratio(floor_s + raw_s, ours_s))])
    print_table("Save against dcp.save's own cost: dcp.save with no storage writes + the raw write "
                f"(of the no-write save, DCP's per-key Stateful check: {floor['stateful_check']['median_s'] * 1e3:.1f} ms)",
                ["threads", "planner", "no-write save ms", "raw write ms", "sum ms", "ours ms", "sum / ours"], rows)


def report(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Print the tables; return the target checks."""
    if "main" not in res:  # --save-only
        checks: list[dict[str, Any]] = []
        report_saves(res["save"]["save"], checker(checks))
        return checks
    main, ceil = res["main"], res["main"]["ceilings"]
    checks = []
    check = checker(checks)

    print_table(
        f"Raw ceilings ({res['procs']} process(es), {res['total_bytes'] / GB:.2f} GB; medians: writes and memcpy of "
        f"{res['repeat']}, reads of every one paired with a load, parallel reads by {ceil['read_warm_parallel']['threads']} "
        "threads per process)",
        ["measure", "GB/s", "best GB/s"],
        [
            [name, fmt(ceil[key]["gbps"] if ceil[key] else None), fmt(ceil[key]["best_gbps"] if ceil[key] else None)]
            for name, key in [
                ("sequential write + fsync", "write_fsync"),
                ("sequential read, cold", "read_cold"),
                ("sequential read, warm", "read_warm"),
                ("parallel read, cold", "read_cold_parallel"),
                ("parallel read, warm", "read_warm_parallel"),
                ("memcpy (copy_)", "memcpy"),
            ]
        ],
    )

    report_saves(main["save"], check)
    report_save_floor(main)

    rows = []
    for mode, by_ckpt in main["load"].items():
        for label, row in by_ckpt.items():
            ours_raw = row["ours"]["x_raw"]
            ok = row["stock"]["verified"] and row["ours"]["verified"]
            rows.append(
                [f"{mode} {label}", fmt(row["stock"]["gbps"]), fmt(row["ours"]["gbps"]), fmt(row["ours/stock"]),
                 fmt(row["stock"]["x_raw"]), fmt(ours_raw),
                 f">={TARGETS[mode]} {check(f'load {mode} {label} ours/raw', ours_raw, TARGETS[mode])}",
                 fmt(row["ours"]["x_raw_parallel"]), "yes" if ok else "NO"]
            )
    print_table("Load into preallocated tensors, GB/s (a/raw: median over loads of raw read s / load s, each load "
                "paired with raw reads in its cache state: cold, just before it; warm, at the start of its round; "
                "ours/stock: median over rounds of stock s / ours s)",
                ["mode / checkpoint", "stock", "ours", "ours/stock", "stock/raw", "ours/raw", "target", "ours/parallel raw",
                 "verified"],
                rows)

    report_floor(main)

    zstd = main["compression"]
    plain_save = main["save"][str(zstd["threads"])]["ours"]["gbps"]
    plain_load = main["load"]["warm"]["ours-written"]["ours"]["gbps"]
    print_table(
        f"ShardWriter(compression='zstd') vs plain, {zstd['threads']} writer threads (GB/s of tensor bytes)",
        ["case", "stored GB", "x plain size", "save GB/s", "x plain save", "warm load GB/s", "x plain load", "verified"],
        [["zstd", fmt(zstd["stored_bytes"] / GB, ".3f"), fmt(ratio(zstd["stored_bytes"], zstd["plain_stored_bytes"]), ".3f"),
          fmt(zstd["save"]["gbps"]), fmt(ratio(zstd["save"]["gbps"], plain_save)), fmt(zstd["load_warm"]["gbps"]),
          fmt(ratio(zstd["load_warm"]["gbps"], plain_load)), "yes" if zstd["verified"] else "NO"]],
    )

    rows = []
    for case in ("split", "merge"):
        part = res[case]
        for label, row in part["load"].items():
            for kind in READERS:
                r = row[kind]
                amp = r["read_amplification"]
                target = (f"<={TARGETS['amplification']} "
                          f"{check(f'{case} {label} amplification', amp, TARGETS['amplification'], False)}"
                          if kind == "ours" else "")
                rows.append(
                    [f"{case} {part['saved_ranks']}->{part['loaded_ranks']} {part['mode']} {label}", kind,
                     fmt(r["gbps"]), fmt(r["bytes_needed"] / GB, ".3f"), fmt(r["bytes_read"] / GB, ".3f"),
                     fmt(amp, ".3f"), fmt(r["rchar_amplification"], ".3f"), "yes" if r["verified"] else "NO", target]
                )
    print_table("Resharded load (amplification = bytes read / bytes needed, summed over ranks)",
                ["case", "reader", "GB/s", "needed GB", "read GB", "amplif.", "rchar amplif.", "verified", "target"],
                rows)
    return checks


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=positive_float, default=1.0, help="state dict size in GiB (default 1)")
    p.add_argument("--procs", type=positive_int, default=1, help="gloo processes for the main run (default 1: none)")
    p.add_argument("--dir", type=existing_dir, default=None, help="parent of the temporary work dir (default /tmp)")
    p.add_argument("--repeat", type=positive_int, default=3, help="repeats per measurement; the median is reported")
    p.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2], help="writer thread counts (default 1 2)")
    p.add_argument("--json", type=output_file, default=None, help=f"result file (default {DEFAULT_JSON}; {SAVE_JSON} with --save-only)")
    p.add_argument("--save-only", action="store_true", help="run only the save section (ceilings, stock, ours)")
    p.add_argument("--keep", action="store_true", help="keep the work dir with its checkpoints")
    p.add_argument("--same-dir", action="store_true",
                   help="save into one directory per kind again and again, as a job saving into one directory does "
                        "(raw and stock rewrite their files, ours retires the last save's); default: a fresh one each time")
    p.add_argument("--state-layout", choices=STATE_LAYOUTS, default="nested",
                   help="nested (default): dcp.save/load get {'model': {name: tensor}}, as a training job passes them; "
                        "flat: every tensor a top-level key (DCP's per-key Stateful checks and logs in every figure)")
    args = p.parse_args(argv)
    if not args.save_only and importlib.util.find_spec("zstandard") is None:
        # checked up front: the zstd section runs last, after minutes of measurements
        p.error("the compression section needs the zstandard package (pip install zstandard), or pass --save-only")
    if args.json is None:
        args.json = output_file(str(SAVE_JSON if args.save_only else DEFAULT_JSON))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="dcp_ext_io_", dir=args.dir))
    cfg = Config(build_specs(args.size_gib), workdir, tuple(args.threads), args.repeat, args.procs, args.state_layout,
                 args.same_dir)
    started = time.perf_counter()
    try:
        res: dict[str, Any] = {
            "procs": args.procs,
            "state_layout": args.state_layout,
            "same_dir": args.same_dir,
            "repeat": args.repeat,
            "size_gib": args.size_gib,
            "total_bytes": cfg.total_bytes,
            "tensors": len(cfg.specs),
            "mix": {label: {"bytes_each": nbytes, "count": sum(s.name.startswith(f"{label}.") for s in cfg.specs)}
                    for label, nbytes, _ in SIZE_MIX},
            "workdir": str(workdir),
            "env": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_at_start": os.getloadavg()},
        }
        if args.save_only:
            res["save"] = run_phase("save", args.procs, cfg)
        else:
            res |= {phase: run_phase(phase, world, cfg) for phase, world in
                    (("main", args.procs), ("split", 2 * args.procs), ("merge", 1))}
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - started
    res["env"]["loadavg_at_end"] = os.getloadavg()
    res["targets"] = report(res)
    print(f"\nstate dict layout: {res['state_layout']} (--state-layout)")
    print(f"saves: {'into one directory per kind again and again' if res['same_dir'] else 'each into a fresh directory'} (--same-dir)")
    print(f"load average at start/end: {res['env']['loadavg_at_start'][0]:.1f}/{res['env']['loadavg_at_end'][0]:.1f}"
          f" on {os.cpu_count()} CPUs (other work on the host skews every figure)")
    print(f"wall time {res['wall_s']:.1f} s; work dir {workdir}{' (kept)' if args.keep else ' (removed)'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2, default=str))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
