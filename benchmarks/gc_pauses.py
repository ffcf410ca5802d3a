"""What each save and load path costs in CPython's full garbage collections, amortized.

A full (generation 2) collection walks every object of the process (~120 ms in a process
that has imported torch and holds a 1 GiB state dict). CPython runs one once the objects
that survived younger collections since the last one pass a quarter of the long-lived
ones, so its cost falls on whichever save or load crosses that line, and the pause per
operation, amortized, is set by how many objects each operation keeps alive long enough.
io_throughput.py times its samples with the collector off to keep this noise out of its
ratios; this benchmark measures it: each path saves (then loads) ``--ops`` times back to back
from a collected heap, and a ``gc.callbacks`` hook counts and times the collections.

Stock is ``FileSystemWriter``/``FileSystemReader`` with DCP's default planners; ours is
``ShardWriter``/``ShardReader`` with ``ShardSavePlanner``/``ShardLoadPlanner``; neither
fsyncs (the objects, not the disk, are measured), one process, io_throughput's tensor mix.

Usage: ``python benchmarks/gc_pauses.py [--size-gib 1] [--ops 12] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from cli_args import existing_dir, output_file, positive_float, positive_int
from io_throughput import Config, Group, build_specs, make_state, print_table

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "gc_pauses.json"


class Collections:
    """Counts and times collections by generation while installed."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.full_seconds: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.count[info["generation"]] += 1
        if info["generation"] == 2:
            self.full_seconds.append(time.perf_counter() - self._started)


def series(op: Callable[[int], object], ops: int) -> dict[str, Any]:
    """``ops`` calls of ``op`` back to back from a collected heap, with their collections."""
    gc.collect()
    seen = Collections()
    gc.callbacks.append(seen)
    started = time.perf_counter()
    try:
        for n in range(ops):
            op(n)
    finally:
        gc.callbacks.remove(seen)
    return {
        "ops": ops,
        "seconds_per_op": (time.perf_counter() - started) / ops,
        "collections_per_op": [c / ops for c in seen.count],
        "full_ms_each": statistics.median(seen.full_seconds) * 1e3 if seen.full_seconds else None,
        "full_ms_per_op": sum(seen.full_seconds) * 1e3 / ops,
    }


def measure(workdir: Path, size_gib: float, ops: int) -> dict[str, Any]:
    cfg = Config(build_specs(size_gib), workdir, (1,), 1, 1)
    state = make_state(cfg, Group(0, 1, None), filled=True)
    results: dict[str, Any] = {"tensors": len(cfg.specs), "objects": len(gc.get_objects()), "ops": ops}
    for kind in ("stock", "ours"):
        paths = [workdir / f"{kind}_{n}" for n in range(2)]  # the previous save stays until the next replaces it

        def save(n: int, kind: str = kind, paths: list[Path] = paths) -> None:
            path = paths[n % 2]
            shutil.rmtree(path, ignore_errors=True)
            if kind == "stock":
                dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=False), no_dist=True)
            else:
                dcp.save(state, storage_writer=ShardWriter(path, sync_files=False), planner=ShardSavePlanner(), no_dist=True)

        def load(n: int, kind: str = kind, paths: list[Path] = paths) -> None:
            if kind == "stock":
                dcp.load(state, storage_reader=dcp.FileSystemReader(paths[0]), no_dist=True)
            else:
                dcp.load(state, storage_reader=ShardReader(paths[0], cache_metadata=False), planner=ShardLoadPlanner(), no_dist=True)

        results[kind] = {"save": series(save, ops), "load": series(load, ops)}
    return results


def report(results: dict[str, Any]) -> None:
    rows = []
    for op in ("save", "load"):
        for kind in ("stock", "ours"):
            r = results[kind][op]
            each = "-" if r["full_ms_each"] is None else f"{r['full_ms_each']:.0f}"
            rows.append([op, kind, f"{r['seconds_per_op'] * 1e3:.0f}", " / ".join(f"{c:.2f}" for c in r["collections_per_op"]),
                         each, f"{r['full_ms_per_op']:.1f}"])
    print_table(
        f"Collections per operation, {results['tensors']} tensors, {results['objects']:,} objects in the process "
        f"({results['ops']} back-to-back operations per row)",
        ["op", "path", "ms per op", "gen 0 / 1 / 2 per op", "full ms each", "full ms per op"],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=positive_float, default=1.0, help="state dict size (default 1: 1,180 tensors)")
    parser.add_argument("--ops", type=positive_int, default=12, help="saves and loads per path (default 12)")
    parser.add_argument("--dir", type=existing_dir, default=None, help="parent of the temporary work dir")
    parser.add_argument("--json", type=output_file, default=DEFAULT_JSON, help=f"result file (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="dcp_ext_gc_", dir=args.dir))
    try:
        results = measure(workdir, args.size_gib, args.ops)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(results)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
