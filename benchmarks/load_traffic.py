"""Storage traffic of a load at 4 processes: stock DCP vs ShardReader vs two-stage, and locality.

Two phases, each a 4-process gloo job on CPU over the same data:

* ``dp``: every rank loads the whole state (DP=4, the worst case for re-reading): stock
  ``FileSystemReader``, plain ``ShardReader`` and ``ShardReader(two_stage=True)``, each
  after dropping the page cache where permitted. Reports bytes read from storage summed
  over ranks (``/proc/self/io`` rchar, the same meter for all three; ``reader.stats`` for
  ours), as a multiple of the unique bytes, and wall time.
* ``tp``: TP=4 x DP=1 with TP-sharded matrices and TP-replicated vectors, saved without and
  with ``ShardSavePlanner(replica_locality=True)`` and reloaded at the same layout: files
  opened per rank (ours from ``reader.stats``; stock: the distinct files of its read items).

Usage: ``python benchmarks/load_traffic.py [--size-mib 512] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from io_throughput import Group, drop_caches, free_port, join_gloo, print_table, proc_rchar, timed
from cli_args import output_file, positive_int

WORLD = 4
TENSORS = 32


class FileCountingReader(dcp.FileSystemReader):
    """Stock reader that records which files its read items touch."""

    files: set[str] = set()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        self.files = {self.storage_data[i.storage_index].relative_path for i in plan.items}
        return super().read_data(plan, planner)


def dp_state(size_mib: int) -> dict[str, torch.Tensor]:
    rows = size_mib * (1 << 20) // TENSORS // 4 // 1024
    return {f"layer{i}.weight": torch.full((rows, 1024), float(i)) + torch.arange(1024.0) for i in range(TENSORS)}


def load_dp(group: Group, path: str, kind: str, size_mib: int) -> dict[str, Any]:
    state = {k: torch.zeros_like(v) for k, v in dp_state(size_mib).items()}
    reader = {"stock": lambda: dcp.FileSystemReader(path), "plain": lambda: ShardReader(path, cache_metadata=False),
              "two_stage": lambda: ShardReader(path, cache_metadata=False, two_stage=True)}[kind]()
    cold = drop_caches(group)
    before = proc_rchar()
    seconds = timed(group, lambda: dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner()))
    rchar = group.gather(proc_rchar() - before)
    ok = all(torch.equal(state[k], v) for k, v in dp_state(size_mib).items())
    stats = group.gather(getattr(reader, "stats", None) and reader.stats.bytes_read)
    return {"reader": kind, "cold": cold, "seconds": seconds, "rchar": sum(rchar),
            "stats_bytes": None if stats[0] is None else sum(stats), "bit_exact": all(group.gather(ok))}


def phase_dp(group: Group, workdir: str, size_mib: int) -> dict[str, Any]:
    path = f"{workdir}/dp"
    dcp.save(dp_state(size_mib), storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    unique = sum(t.numel() * t.element_size() for t in dp_state(size_mib).values())
    return {"unique_bytes": unique, "loads": [load_dp(group, path, k, size_mib) for k in ("stock", "plain", "two_stage")]}


def tp_state() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    state = {}
    for layer in range(8):
        state[f"layers.{layer}.fc1.weight"] = distribute_tensor(torch.randn(512, 256, generator=g), mesh, [Replicate(), Shard(0)])
        state[f"layers.{layer}.norm.weight"] = distribute_tensor(torch.randn(256, generator=g), mesh, [Replicate(), Replicate()])
        state[f"layers.{layer}.fc2.bias"] = distribute_tensor(torch.randn(256, generator=g), mesh, [Replicate(), Replicate()])
    return state


def phase_tp(group: Group, workdir: str, size_mib: int) -> dict[str, Any]:
    out = {}
    for locality in (False, True):
        path = f"{workdir}/tp_{'locality' if locality else 'plain'}"
        dcp.save(tp_state(), storage_writer=ShardWriter(path), planner=ShardSavePlanner(replica_locality=locality))
        reader = ShardReader(path, cache_metadata=False)
        dcp.load(tp_state(), storage_reader=reader, planner=ShardLoadPlanner())
        out["locality" if locality else "plain"] = group.gather(reader.stats.files_opened)
        if not locality:
            stock = FileCountingReader(path)
            dcp.load(tp_state(), storage_reader=stock)
            out["stock"] = group.gather(len(stock.files))
    out["own_files"] = group.gather(sum(1 for p in Path(f"{workdir}/tp_locality").glob(f"__{group.rank}_*.distcp")))
    return out


PHASES = {"dp": phase_dp, "tp": phase_tp}


def _worker(rank: int, port: int, phase: str, workdir: str, size_mib: int) -> None:
    join_gloo(rank, WORLD, port)
    try:
        result = PHASES[phase](Group(rank, WORLD, None), workdir, size_mib)
        if rank == 0:
            Path(workdir, f"{phase}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run(phase: str, workdir: str, size_mib: int) -> dict[str, Any]:
    mp.spawn(_worker, args=(free_port(), phase, workdir, size_mib), nprocs=WORLD, join=True)
    return json.loads(Path(workdir, f"{phase}.json").read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=positive_int, default=512)
    parser.add_argument("--json", type=output_file, default="benchmarks/results/load_traffic.json")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="dcp_ext_traffic_")
    try:
        results = {"dp": run("dp", workdir, args.size_mib), "tp": run("tp", workdir, args.size_mib)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    dp = results["dp"]
    unique = dp["unique_bytes"]
    print_table(
        f"DP={WORLD}: every rank loads all {unique / 1e6:.0f} MB (bytes from storage summed over ranks)",
        ["reader", "rchar GB", "x unique", "stats GB", "seconds", "cold", "bit-exact"],
        [[r["reader"], f"{r['rchar'] / 1e9:.3f}", f"{r['rchar'] / unique:.2f}",
          "-" if r["stats_bytes"] is None else f"{r['stats_bytes'] / 1e9:.3f}", f"{r['seconds']:.2f}",
          str(r["cold"]), str(r["bit_exact"])] for r in dp["loads"]],
    )
    tp = results["tp"]
    print_table(
        f"TP={WORLD} x DP=1, same layout: files opened per rank",
        ["reader", *[f"rank {r}" for r in range(WORLD)]],
        [[name, *map(str, tp[key])] for name, key in
         (("stock FileSystemReader", "stock"), ("ShardReader", "plain"),
          ("ShardReader + replica_locality", "locality"), ("own data files", "own_files"))],
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nresults: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
