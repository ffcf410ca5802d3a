"""How long ``dcp.async_save`` blocks the training step, stock DCP versus ``ShardWriter``.

For a CPU state dict (default ~1 GiB over 200 tensors, fp32/bf16 alternating) measures, with
DCP's thread and process executors (``AsyncCheckpointerType``), per save:

* blocking: wall time until ``dcp.async_save`` returns (staging; the step waits this long);
* total: wall time until ``.result()`` (staging plus the background write with fsync);
* RSS of the training process after the save.

Cases: (a) stock ``FileSystemWriter``: DCP builds a fresh ``DefaultStager`` per call, so every
save stages into new memory; (b) ``ShardWriter``'s first save through ``writer.async_save``
(cold: its staging buffers are allocated and page-faulted); (c) the same writer's later
saves (staging reused).
Every save finishes (``.result()``) before the next starts, so blocking is staging alone.

The yardstick is the plain memcpy rate: ``Tensor.copy_`` of the same tensors into
preallocated, already-touched buffers. ``blocking / memcpy`` is the blocking time over the
time such a copy takes (1.0: staging costs exactly one memcpy).

Each (executor, writer) pair runs in its own fresh process (a one-rank gloo group, which
the process executor needs, one intra-op thread), so RSS figures do not mix; the process
executor's checkpoint process is started by an untimed warm-up save.

Usage::

    python benchmarks/async_save.py                          # ~1 GiB, 200 tensors, 3 repeats
    python benchmarks/async_save.py --gib 0.5 --repeats 4 --dir /scratch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.storage import StorageWriter

from dcp_ext import ShardWriter

sys.path.insert(0, os.path.dirname(__file__))
from cli_args import existing_dir, output_file, positive_float, positive_int  # noqa: E402
from io_throughput import COLS, GB, TensorSpec, fill_rows, fmt, free_port, join_gloo, print_table  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "async_save.json"
MIB = 1 << 20
EXECUTORS = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
WRITERS = ("stock", "ours")


@dataclass(frozen=True)
class Config:
    """What every worker needs; picklable for spawned workers."""

    specs: tuple[TensorSpec, ...]
    workdir: Path
    repeats: int
    threads: int

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def build_specs(gib: float, tensors: int) -> tuple[TensorSpec, ...]:
    """``tensors`` equal-sized (rows, COLS) tensors totalling about ``gib`` GiB."""
    rows = max(1, round(gib * (1 << 30) / (tensors * COLS * 4)))
    specs = []
    for i in range(tensors):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        specs.append(TensorSpec(f"layer{i}.w", rows * (4 // dtype.itemsize), dtype, i * 1_000_003))
    return tuple(specs)


def make_state(cfg: Config) -> dict[str, torch.Tensor]:
    return {s.name: fill_rows(s, 0, s.rows) for s in cfg.specs}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memcpy_seconds(state: dict[str, torch.Tensor], repeats: int) -> list[float]:
    """Seconds of copying every tensor into preallocated buffers touched by a first copy."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    out = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        out.append(time.perf_counter() - start)
    return out[1:]


def make_writer(kind: str, path: Path, threads: int) -> StorageWriter:
    if kind == "stock":
        return dcp.FileSystemWriter(path, thread_count=threads, sync_files=True)
    return ShardWriter(path, thread_count=threads, sync_files=True)


def timed_save(
    state: dict[str, torch.Tensor], writer: StorageWriter, executor: AsyncCheckpointerType
) -> dict[str, float]:
    """One async save: seconds until it returned, seconds until ``.result()``, RSS after.

    Stock: ``dcp.async_save`` (its own ``DefaultStager``); ours: ``writer.async_save``, which
    calls it with the writer as stager and keeps the future, so it can reuse the staging copy.
    """
    start = time.perf_counter()
    if isinstance(writer, ShardWriter):
        fut = writer.async_save(state, async_checkpointer_type=executor)
    else:
        fut = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=executor)
    blocking = time.perf_counter() - start
    fut.result()
    return {"blocking_s": blocking, "total_s": time.perf_counter() - start, "rss_after": rss_bytes()}


def run_pair(cfg: Config, executor_name: str, kind: str) -> dict[str, Any]:
    """``1 + repeats`` saves of one writer kind under one executor, in this process."""
    executor = EXECUTORS[executor_name]
    path = cfg.workdir / f"{executor_name}_{kind}"
    state = make_state(cfg)
    memcpy = memcpy_seconds(state, cfg.repeats)
    if executor == AsyncCheckpointerType.PROCESS:  # start DCP's checkpoint process, untimed
        warmup = make_writer("stock", cfg.workdir / "warmup", 1)
        dcp.async_save({"warm": torch.zeros(1)}, storage_writer=warmup, async_checkpointer_type=executor).result()
    rss_before = rss_bytes()
    writer = make_writer(kind, path, cfg.threads)  # one writer for all saves; stock stages anew anyway
    saves = [timed_save(state, writer, executor) for _ in range(1 + cfg.repeats)]
    return {"memcpy_s": memcpy, "rss_before": rss_before, "saves": saves}


def _worker(rank: int, port: int, cfg: Config, executor_name: str, kind: str, out: str) -> None:
    """A spawned one-rank job: run the pair, write its result as JSON.

    One intra-op thread: on a shared box, a parallel copy_ stalls whenever one of its threads
    is descheduled, which swamps the figures; memcpy and staging both run with one.
    """
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # stock, every save
    join_gloo(rank, 1, port)
    try:
        Path(out).write_text(json.dumps(run_pair(cfg, executor_name, kind)))
    finally:
        dist.destroy_process_group()


def run_in_process(cfg: Config, executor_name: str, kind: str) -> dict[str, Any]:
    print(f"[async_save] {executor_name} executor, {kind} writer", file=sys.stderr, flush=True)
    out = cfg.workdir / f"result_{executor_name}_{kind}.json"
    mp.spawn(_worker, args=(free_port(), cfg, executor_name, kind, str(out)), nprocs=1, join=True)
    shutil.rmtree(cfg.workdir / f"{executor_name}_{kind}", ignore_errors=True)
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- report


def case_rows(run: dict[str, Any], kind: str, nbytes: int) -> dict[str, dict[str, float]]:
    """Per case: median blocking and total seconds, blocking / memcpy time, RSS growth.

    RSS growth: stock over all its saves; cold over the first save; reused from after the
    first save to after the last.
    """
    memcpy_s = statistics.median(run["memcpy_s"])
    saves, rss0 = run["saves"], run["rss_before"]
    if kind == "stock":
        groups = {"stock": (saves, rss0)}
    else:
        groups = {"cold": (saves[:1], rss0), "reused": (saves[1:], saves[0]["rss_after"])}
    rows = {}
    for case, (group, base) in groups.items():
        blocking = statistics.median(s["blocking_s"] for s in group)
        rows[case] = {
            "saves": len(group),
            "blocking_s": blocking,
            "blocking_over_memcpy": blocking / memcpy_s,
            "total_s": statistics.median(s["total_s"] for s in group),
            "rss_growth_mib": (group[-1]["rss_after"] - base) / MIB,
            "memcpy_gbps": nbytes / memcpy_s / GB,
        }
    return rows


CASE_LABELS = {
    "stock": "(a) stock FileSystemWriter + DefaultStager",
    "cold": "(b) ShardWriter, first save (cold)",
    "reused": "(c) ShardWriter, later saves (reused)",
}


def report(res: dict[str, Any]) -> None:
    rows = []
    for executor, cases in res["cases"].items():
        for case, r in cases.items():
            rows.append(
                [executor, CASE_LABELS[case], str(r["saves"]), fmt(r["blocking_s"], ".3f"),
                 fmt(r["blocking_over_memcpy"]), fmt(r["memcpy_gbps"]), fmt(r["total_s"], ".2f"),
                 fmt(r["rss_growth_mib"], ".0f")]
            )
    print_table(
        f"dcp.async_save, {res['total_bytes'] / GB:.2f} GB in {res['tensors']} CPU tensors, "
        f"1 rank, writer threads {res['threads']} (medians)",
        ["executor", "case", "saves", "blocking s", "blocking/memcpy", "memcpy GB/s", "total s", "RSS growth MiB"],
        rows,
    )


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=positive_float, default=1.0, help="state dict size in GiB (default 1)")
    p.add_argument("--tensors", type=positive_int, default=200, help="number of tensors (default 200)")
    p.add_argument("--repeats", type=positive_int, default=3, help="saves after the first per case (default 3)")
    p.add_argument("--threads", type=positive_int, default=2, help="writer threads, both writers (default 2)")
    p.add_argument("--dir", type=existing_dir, default=None, help="parent of the temporary work dir (default /tmp)")
    p.add_argument("--json", type=output_file, default=str(DEFAULT_JSON), help=f"result file (default {DEFAULT_JSON})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="dcp_ext_async_", dir=args.dir))
    cfg = Config(build_specs(args.gib, args.tensors), workdir, args.repeats, args.threads)
    started = time.perf_counter()
    res: dict[str, Any] = {
        "gib": args.gib,
        "tensors": len(cfg.specs),
        "total_bytes": cfg.total_bytes,
        "repeats": args.repeats,
        "threads": args.threads,
        "env": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "loadavg_at_start": os.getloadavg()},
    }
    try:
        res["runs"] = {ex: {kind: run_in_process(cfg, ex, kind) for kind in WRITERS} for ex in EXECUTORS}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["cases"] = {
        ex: {case: row for kind in WRITERS for case, row in case_rows(runs[kind], kind, cfg.total_bytes).items()}
        for ex, runs in res["runs"].items()
    }
    res["wall_s"] = time.perf_counter() - started
    res["env"]["loadavg_at_end"] = os.getloadavg()
    report(res)
    print(f"\nload average at start/end: {res['env']['loadavg_at_start'][0]:.1f}/{res['env']['loadavg_at_end'][0]:.1f}"
          f" on {os.cpu_count()} CPUs (other work on the host skews every figure)")
    print(f"wall time {res['wall_s']:.1f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2, default=str))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
