"""Safetensors in and out: ShardReader vs stock HuggingFaceStorageReader vs load_file + slicing.

A sharded safetensors checkpoint (written by ``huggingface_hub.save_torch_state_dict``,
default ~1 GiB in 64 tensors, fp32/bf16, 256 MB shards) is loaded at 1 and 2 processes,
each rank taking its ``Shard(0)`` rows of every tensor (the whole tensor at 1 process):

* ``ours``: ``ShardReader`` + ``ShardLoadPlanner`` into DTensors;
* ``stock``: ``HuggingFaceStorageReader`` + ``DefaultLoadPlanner`` into the same DTensors;
* ``load_file``: ``safetensors.torch.load_file`` of every shard, then copying the rank's
  rows (what user code does today).

Each with a cold page cache (dropped where permitted) and warm. Read amplification is
the bytes fetched from storage in a cold load (``/proc/self/io`` ``read_bytes``: the
only meter that counts safetensors' mmap page faults), summed over ranks, over the
bytes the ranks need. The raw sequential read of one file of the same size is the
ceiling. Export: ``export_safetensors`` of a ShardWriter checkpoint of the same tensors
against a sequential write + fsync of the same bytes.

Usage: ``python benchmarks/hf_io.py [--size-mib 1024] [--repeat 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter, export_safetensors
from cli_args import output_file, positive_int
from io_throughput import Group, drop_caches, free_port, join_gloo, print_table, proc_read_bytes, read_file, timed, write_file

TENSORS = 64
COLS = 1024
READERS = ("ours", "stock", "load_file")
TARGETS = {"ours_over_stock": 2.0, "amplification": 1.05, "export_over_write": 0.7}


def full_tensors(size_mib: int) -> dict[str, torch.Tensor]:
    """Deterministic tensors, half fp32 and half bf16, rows not divisible by 2 or 4."""
    rows = size_mib * (1 << 20) // TENSORS // 4 // COLS
    out = {}
    for i in range(TENSORS):
        base = torch.arange(COLS, dtype=torch.float32) + i
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        out[f"layers.{i}.weight"] = (torch.arange(rows + i % 3, dtype=torch.float32)[:, None] * 0.5 + base).to(dtype)
    return out


def destinations(group: Group, size_mib: int) -> dict[str, Any]:
    """Garbage-filled destinations: DTensors Shard(0) at >1 process, plain tensors at 1."""
    full = full_tensors(size_mib)
    if group.world == 1:
        return {k: torch.full_like(v, -7) for k, v in full.items()}
    mesh = init_device_mesh("cpu", (group.world,))
    return {k: distribute_tensor(torch.full_like(v, -7), mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}


def local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def rows_of(value: Any, full: torch.Tensor) -> slice:
    """The rows of ``full`` this rank's destination holds."""
    if not hasattr(value, "to_local"):
        return slice(0, full.shape[0])
    offset = value.device_mesh.get_coordinate()[0]
    per = -(-full.shape[0] // value.device_mesh.size())
    return slice(min(offset * per, full.shape[0]), min((offset + 1) * per, full.shape[0]))


def load_with(kind: str, path: str, state: dict[str, Any]) -> None:
    if kind == "ours":
        dcp.load(state, storage_reader=ShardReader(path, cache_metadata=False), planner=ShardLoadPlanner())
    elif kind == "stock":
        dcp.load(state, storage_reader=HuggingFaceStorageReader(path), planner=DefaultLoadPlanner())
    else:  # what user code does: every shard file whole, then this rank's rows
        for file in sorted(Path(path).glob("*.safetensors")):
            for key, tensor in load_file(str(file)).items():
                local(state[key]).copy_(tensor[rows_of(state[key], tensor)])


def bit_exact(state: dict[str, Any], size_mib: int) -> bool:
    return all(torch.equal(local(state[k]), v[rows_of(state[k], v)]) for k, v in full_tensors(size_mib).items())


def phase_load(group: Group, workdir: str, size_mib: int, repeat: int) -> dict[str, Any]:
    path = f"{workdir}/hf"
    state = destinations(group, size_mib)
    needed = sum(local(v).numel() * local(v).element_size() for v in state.values())
    results: dict[str, Any] = {"needed_bytes": sum(group.gather(needed))}
    for kind in READERS:
        for cache in ("cold", "warm"):
            seconds, fetched, exact, cold_ok = [], [], True, True
            for _ in range(repeat):
                for value in state.values():
                    local(value).fill_(-7)
                if cache == "cold":
                    cold_ok = drop_caches(group) and cold_ok
                else:
                    load_with(kind, path, state)  # warm the cache with the same reads
                before = proc_read_bytes()
                seconds.append(timed(group, lambda: load_with(kind, path, state)))
                fetched.append(sum(group.gather(proc_read_bytes() - before)))
                exact = exact and all(group.gather(bit_exact(state, size_mib)))
            results[f"{kind}_{cache}"] = {"seconds": seconds, "median_s": statistics.median(seconds),
                                          "read_bytes": statistics.median(fetched), "bit_exact": exact,
                                          "cold": cold_ok if cache == "cold" else None}
    return results


def _worker(rank: int, world: int, port: int, workdir: str, size_mib: int, repeat: int) -> None:
    join_gloo(rank, world, port)
    try:
        result = phase_load(Group(rank, world, None), workdir, size_mib, repeat)
        if rank == 0:
            Path(workdir, f"load_{world}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_loads(world: int, workdir: str, size_mib: int, repeat: int) -> dict[str, Any]:
    print(f"[hf_io] loads at {world} process(es)", file=sys.stderr, flush=True)
    if world == 1:
        return phase_load(Group(0, 1, None), workdir, size_mib, repeat)
    mp.spawn(_worker, args=(world, free_port(), workdir, size_mib, repeat), nprocs=world, join=True)
    return json.loads(Path(workdir, f"load_{world}.json").read_text())


def ceilings(workdir: str, nbytes: int, repeat: int) -> dict[str, float]:
    """Median seconds of a sequential write + fsync and of cold / warm sequential reads."""
    lone = Group(0, 1, None)
    raw = Path(workdir, "raw.bin")
    buf = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
    write_s = [timed(lone, lambda: write_file(raw, nbytes)) for _ in range(repeat)]
    cold_s = []
    for _ in range(repeat):
        drop_caches(lone)
        cold_s.append(timed(lone, lambda: read_file(raw, buf)))
    warm_s = [timed(lone, lambda: read_file(raw, buf)) for _ in range(repeat)]
    raw.unlink()
    return {"write_fsync_s": statistics.median(write_s), "read_cold_s": statistics.median(cold_s),
            "read_warm_s": statistics.median(warm_s)}


def measure_export(workdir: str, size_mib: int, repeat: int) -> dict[str, Any]:
    src = f"{workdir}/dcp"
    dcp.save(full_tensors(size_mib), storage_writer=ShardWriter(src), planner=ShardSavePlanner())
    os.sync()  # the source's write-back must not run during the timed exports (the ceiling had none)
    seconds = []
    for n in range(repeat):
        dst = f"{workdir}/export{n}"
        seconds.append(timed(Group(0, 1, None), lambda: export_safetensors(src, dst, max_shard_bytes=256_000_000)))
        shutil.rmtree(dst)
    return {"seconds": seconds, "median_s": statistics.median(seconds)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=positive_int, default=1024)
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--json", type=output_file, default="benchmarks/results/hf_io.json")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="dcp_ext_hf_io_")
    try:
        full = full_tensors(args.size_mib)
        total = sum(t.numel() * t.element_size() for t in full.values())
        Path(workdir, "hf").mkdir()
        save_torch_state_dict(full, f"{workdir}/hf", max_shard_size="256MB")
        del full
        results = {"total_bytes": total, "ceilings": ceilings(workdir, total, args.repeat),
                   "loads": {str(w): run_loads(w, workdir, args.size_mib, args.repeat) for w in (1, 2)},
                   "export": measure_export(workdir, args.size_mib, args.repeat)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(results)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nresults: {args.json}", file=sys.stderr)


def report(results: dict[str, Any]) -> None:
    total, ceil = results["total_bytes"], results["ceilings"]
    rows = []
    for world, loads in results["loads"].items():
        for cache in ("cold", "warm"):
            raw_s = ceil[f"read_{cache}_s"]
            for kind in READERS:
                r = loads[f"{kind}_{cache}"]
                rows.append([f"{world}", cache, kind, f"{r['median_s']:.3f}", f"{total / r['median_s'] / 1e9:.2f}",
                             f"{raw_s / r['median_s']:.2f}",
                             f"{r['read_bytes'] / loads['needed_bytes']:.3f}" if cache == "cold" else "-",
                             f"{loads[f'stock_{cache}']['median_s'] / r['median_s']:.2f}", str(r["bit_exact"])])
    print_table(f"Loads of {total / 1e9:.2f} GB of safetensors (each rank its Shard(0) rows)",
                ["procs", "cache", "reader", "seconds", "GB/s", "x raw read", "read ampl.", "x stock", "bit-exact"], rows)
    export = results["export"]
    write_ratio = ceil["write_fsync_s"] / export["median_s"]
    print_table("Export to safetensors (ShardWriter checkpoint -> shards + index)",
                ["measure", "seconds", "GB/s", "x write ceiling"],
                [["export_safetensors", f"{export['median_s']:.3f}", f"{total / export['median_s'] / 1e9:.2f}", f"{write_ratio:.2f}"],
                 ["write + fsync ceiling", f"{ceil['write_fsync_s']:.3f}", f"{total / ceil['write_fsync_s'] / 1e9:.2f}", "1.00"]])
    two = results["loads"]["2"]
    checks = {
        "ours_over_stock (2 procs, cold)": (two["stock_cold"]["median_s"] / two["ours_cold"]["median_s"], TARGETS["ours_over_stock"], True),
        "read amplification (2 procs, ours, cold)": (two["ours_cold"]["read_bytes"] / two["needed_bytes"], TARGETS["amplification"], False),
        "export / write ceiling": (write_ratio, TARGETS["export_over_write"], True),
    }
    print_table("Targets", ["measure", "value", "target", "verdict"],
                [[name, f"{v:.2f}", f"{'>=' if up else '<='} {t}", "PASS" if (v >= t if up else v <= t) else "FAIL"]
                 for name, (v, t, up) in checks.items()])


if __name__ == "__main__":
    main()
