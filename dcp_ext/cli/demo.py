"""`dcp-ext demo`: save a sharded model at one world size, reload it at another, prove it.

A gloo group of `save_world` CPU processes trains a toy FSDP2 + tensor-parallel model for
one AdamW step and saves model and optimizer state with `ShardWriter`. A second group of
`load_world` processes then loads that checkpoint, resharded, with `ShardReader` and with
stock DCP's `FileSystemReader`, checks every value bit-exact against full tensors recorded
before the save, and times both loads. Every rank's `SaveReport` and `LoadReport` (see
`dcp_ext.observe`) are printed as a table: where each rank's time and bytes went.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from dcp_ext import LoadReport, SaveReport, ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.cli.arg_types import non_empty, positive_int
from dcp_ext.cli.toy_model import build_sharded_model, train_one_step

CHECKPOINT_DIR = "checkpoint"
REFERENCE_FILE = "reference.pt"
SAVE_RESULT = "save_result.json"
LOAD_RESULT = "load_result.json"
# Loads are timed this many times each, interleaved, and the best time is kept, so
# one-off costs (first-call imports, a busy core) do not decide the comparison. Later
# ShardReader rounds hit its per-process metadata cache, as a job's repeated loads would.
LOAD_ROUNDS = 3
# Counts shown after the per-phase seconds in the report tables.
SAVE_COLUMNS = ("bytes_written", "files_written", "items_written")
LOAD_COLUMNS = ("bytes_read", "files_opened", "items_read")
GROUP_TIMEOUT = timedelta(minutes=2)

StateDict = dict[str, Any]


def run_demo(workdir: str | None = None, save_world: int = 4, load_world: int = 2,
             keep: bool = False) -> dict:
    """Run the save/reload round trip and return the report.

    The report's `ok` is False and `mismatches` names the keys when anything loaded
    differs from what was saved. A temporary workdir is deleted unless `keep`; a
    workdir given by the caller is never deleted.
    """
    temporary = not workdir  # None or "": a directory of its own (an empty one was made, then left behind)
    root = Path(tempfile.mkdtemp(prefix="dcp-ext-demo-")) if temporary else Path(workdir)
    try:
        _prepare_workdir(root)
        _spawn(_save_worker, save_world, root)
        _spawn(_load_worker, load_world, root)
        report = _build_report(root, save_world, load_world)
        report["workdir"] = str(root) if keep or not temporary else None
        return report
    finally:
        if temporary and not keep:
            shutil.rmtree(root, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dcp-ext demo`."""
    parser.add_argument("--workdir", default=None, type=non_empty,
                        help="directory for the checkpoint (default: a temp dir)")
    parser.add_argument("--save-world", type=positive_int, default=4,
                        help="processes that save the checkpoint (default: 4)")
    parser.add_argument("--load-world", type=positive_int, default=2,
                        help="processes that reload it (default: 2)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp dir and print where it is")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    """Entry point of `dcp-ext demo`: 0 when every value round-tripped bit-exact."""
    report = run_demo(args.workdir, args.save_world, args.load_world, args.keep)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if not report["ok"]:
        print(f"FAILED: not bit-exact: {', '.join(report['mismatches'])}", file=sys.stderr)
        return 1
    return 0


def format_report(report: dict) -> str:
    """Human-readable form of the report returned by `run_demo`."""
    lines = [
        f"saved at world {report['save_world']}, reloaded at world {report['load_world']}",
        f"checkpoint:   {report['checkpoint_bytes']:,} bytes in "
        f"{report['checkpoint_files']} files",
        f"save:         {report['save_seconds']:.3f} s",
        f"load:         {report['load_seconds']:.3f} s dcp_ext vs "
        f"{report['stock_load_seconds']:.3f} s stock FileSystemReader "
        f"({report['load_speedup']:.2f}x, best of {LOAD_ROUNDS})",
        *_report_table("save", report["save_reports"], SAVE_COLUMNS),
        *_report_table("load", report["load_reports"], LOAD_COLUMNS),
    ]
    if report["workdir"]:
        lines.append(f"workdir:      {report['workdir']}")
    if report["ok"]:
        lines.append(f"OK: {report['tensors_checked']} tensors bit-exact")
    return "\n".join(lines)


def _report_table(kind: str, reports: list[dict], columns: tuple[str, ...]) -> list[str]:
    """One row per rank: each phase's seconds, then the chosen counts (ShardReader: first load)."""
    phases = list(reports[0]["seconds"])
    header = f"{kind + ' (s)':<14}" + "".join(f"{p:>9}" for p in phases) + "".join(f"{c:>15}" for c in columns)
    rows = [
        f"  rank {r['rank']:<6}" + "".join(f"{r['seconds'][p]:>9.3f}" for p in phases)
        + "".join(f"{r[c]:>15,}" for c in columns)
        for r in reports
    ]
    return [header, *rows]


def _prepare_workdir(root: Path) -> None:
    """Refuse a workdir that already holds a checkpoint rather than overwrite it."""
    ckpt = root / CHECKPOINT_DIR
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"{root}: is a file; --workdir takes a directory")
    if ckpt.exists() and any(ckpt.iterdir()):
        raise FileExistsError(f"{ckpt} is not empty; choose another --workdir")
    ckpt.mkdir(parents=True, exist_ok=True)


def _spawn(worker: Callable[[int, int, int, str], None], world: int, root: Path) -> None:
    """Run `worker(rank, world, port, root)` in `world` fresh processes and wait."""
    mp.spawn(worker, args=(world, _free_port(), str(root)), nprocs=world, join=True)


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _process_group(rank: int, world: int, port: int) -> Iterator[None]:
    """A gloo group for this worker, always torn down; one thread so ranks share cores."""
    torch.set_num_threads(1)
    # full_tensor() of FSDP2+TP (_StridedShard) params logs a per-rank "suboptimal
    # all_gather" warning; speed is irrelevant for these few MB.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=GROUP_TIMEOUT)
    try:
        yield
    finally:
        # Collective work objects caught in reference cycles must be freed while the
        # interpreter is whole: freed by the final collection at exit, gloo's threads
        # abort the worker ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


def _save_worker(rank: int, world: int, port: int, root: str) -> None:
    """Train one step, record the full reference tensors, save with ShardWriter."""
    with _process_group(rank, world, port):
        model = build_sharded_model(world)
        optimizer = _make_optimizer(model)
        train_one_step(model, optimizer)
        state = _state_dict(model, optimizer)
        reference = _full_values(state)
        if rank == 0:
            torch.save(reference, Path(root) / REFERENCE_FILE)
        writer = ShardWriter(str(Path(root) / CHECKPOINT_DIR))
        seconds = _timed(lambda: dcp.save(state, storage_writer=writer, planner=ShardSavePlanner()))
        reports = _gather_reports(writer.last_report)
        if rank == 0:
            _write_json(Path(root) / SAVE_RESULT, {"save_seconds": seconds, "save_reports": reports})


def _load_worker(rank: int, world: int, port: int, root: str) -> None:
    """Load with ShardReader and stock DCP at this world size; time and check both."""
    with _process_group(rank, world, port):
        model = build_sharded_model(world)
        optimizer = _make_optimizer(model)
        # get_state_dict creates AdamW state (a zero-lr step), so every key has a target.
        templates = _state_dict(model, optimizer)
        ours, stock = _poisoned_copy(templates), _poisoned_copy(templates)
        ckpt = str(Path(root) / CHECKPOINT_DIR)
        readers, ours_times, stock_times = [], [], []
        for _ in range(LOAD_ROUNDS):
            readers.append(ShardReader(ckpt))
            ours_times.append(_timed(lambda: dcp.load(
                ours, storage_reader=readers[-1], planner=ShardLoadPlanner())))
            stock_times.append(_timed(lambda: dcp.load(
                stock, storage_reader=dcp.FileSystemReader(ckpt))))
        set_state_dict(model, optimizer, model_state_dict=ours["model"],
                       optim_state_dict=ours["optim"])
        reference = torch.load(Path(root) / REFERENCE_FILE, weights_only=True)
        mismatches = _mismatches(reference, _full_values(_state_dict(model, optimizer)))
        mismatches += [f"stock:{key}" for key in _mismatches(reference, _full_values(stock))]
        reports = _gather_reports(readers[0].last_report)
        if rank == 0:
            _write_json(Path(root) / LOAD_RESULT, {
                "load_seconds": min(ours_times),
                "stock_load_seconds": min(stock_times),
                "load_reports": reports,
                "tensors_checked": sum(torch.is_tensor(v) for v in reference.values()),
                "mismatches": mismatches,
            })


def _make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW, so the checkpoint carries exp_avg, exp_avg_sq and step per parameter."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> StateDict:
    """The sharded model + optimizer state in the layout DCP saves and loads."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _timed(action: Callable[[], object]) -> float:
    """Wall seconds for a collective action, measured from all ranks ready to all done."""
    dist.barrier()
    start = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - start


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaves of a nested dict/list state dict as (dotted key, value) pairs."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple))
                                                  or torch.is_tensor(v) for v in value):
        items = enumerate(value)
    else:
        yield prefix, value
        return
    for key, child in items:
        yield from _flatten(child, f"{prefix}.{key}" if prefix else str(key))


def _full_values(state: StateDict) -> dict[str, Any]:
    """Every leaf with DTensors gathered to full tensors; a collective, same order on all ranks."""
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value)
            for key, value in _flatten(state)}


def _poisoned_copy(state: Any) -> Any:
    """A copy whose tensors hold NaN (or -1), so an item the load skips cannot pass."""
    if isinstance(state, dict):
        return {key: _poisoned_copy(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_poisoned_copy(value) for value in state]
    if torch.is_tensor(state):
        return torch.full_like(state, math.nan if state.is_floating_point() else -1)
    return state


def _mismatches(reference: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Keys missing on either side or whose values differ in dtype, shape or any bit."""
    return [key for key in sorted(reference.keys() | actual.keys())
            if key not in reference or key not in actual
            or not _identical(reference[key], actual[key])]


def _identical(expected: Any, actual: Any) -> bool:
    """Bit equality for tensors (dtype included), plain equality for other values."""
    if torch.is_tensor(expected) or torch.is_tensor(actual):
        return (torch.is_tensor(expected) and torch.is_tensor(actual)
                and expected.dtype == actual.dtype and torch.equal(expected, actual))
    return expected == actual


def _gather_reports(report: SaveReport | LoadReport) -> list[dict] | None:
    """Every rank's report as a dict, in rank order, on rank 0 (a collective)."""
    reports: list[dict] | None = [{}] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(report.to_dict(), reports, dst=0)
    return reports


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload))


def _build_report(root: Path, save_world: int, load_world: int) -> dict:
    """Merge what the two groups wrote with the on-disk size of the checkpoint."""
    files = [p for p in (root / CHECKPOINT_DIR).rglob("*") if p.is_file()]
    saved = json.loads((root / SAVE_RESULT).read_text())
    loaded = json.loads((root / LOAD_RESULT).read_text())
    return {
        "save_world": save_world,
        "load_world": load_world,
        "checkpoint_bytes": sum(p.stat().st_size for p in files),
        "checkpoint_files": len(files),
        **saved,
        **loaded,
        "load_speedup": loaded["stock_load_seconds"] / loaded["load_seconds"],
        "ok": not loaded["mismatches"],
    }
