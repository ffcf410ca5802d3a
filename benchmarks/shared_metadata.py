"""Metadata read once per group (``ShardReader(share_metadata=True)``) against once per rank.

    python benchmarks/shared_metadata.py                 # 1.19 M chunks, 4 processes
    python benchmarks/shared_metadata.py --ranks 64 --procs 2

Writes the metadata a ``--ranks``-rank save of ``plan_scale.py``'s 64-layer MoE model
leaves (HSDP x TP x EP: the ``.metadata`` pickle, our index and the commit marker), then
``--procs`` gloo processes call ``ShardReader.read_metadata`` on it together, with and
without sharing, interleaved, metadata cache off, page cache warm. Per mode it reports the
slowest rank's seconds (the load waits for it), the bytes the ranks read through read
syscalls (``rchar``: what a shared file system would serve), and the decoded metadata is
checked equal across modes. JSON: ``benchmarks/results/shared_metadata.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dcp_ext import ShardReader
from dcp_ext.planning.global_plan import plan_globally
from io_throughput import Group, fmt, free_port, join_gloo, print_table, proc_rchar
from cli_args import output_file, positive_int
from plan_scale import RESULTS, TableMaker, coordinator_writer, make_job, write_results

MODES = {"per rank": False, "shared": True}


def write_metadata(path: Path, ranks: int) -> dict[str, int]:
    """The metadata files of a ``ranks``-rank save (its data files empty: only metadata is read)."""
    job = make_job(TableMaker(64), ranks, "hsdp")
    result = plan_globally(job.tables, chunk_digests=job.digests, tp_ranks=job.tp_ranks)
    results = write_results(job, result)
    coordinator_writer(path, results).finish(dataclasses.replace(result.metadata), results)
    return {"chunks": sum(len(m.chunks) for m in result.metadata.state_dict_metadata.values() if hasattr(m, "chunks")),
            **{p.name: p.stat().st_size for p in path.iterdir()}}


def worker(rank: int, world: int, port: int, path: str, repeat: int, out: str) -> None:
    join_gloo(rank, world, port)
    group = Group(rank, world, None)
    try:
        runs: dict[str, list[tuple[float, int]]] = {mode: [] for mode in MODES}
        keys: dict[str, int] = {}
        for _ in range(repeat):
            for mode, shared in MODES.items():
                group.barrier()
                before, start = proc_rchar(), time.perf_counter()
                metadata = ShardReader(path, cache_metadata=False, share_metadata=shared).read_metadata()
                runs[mode].append((time.perf_counter() - start, proc_rchar() - before))
                keys[mode] = len(metadata.state_dict_metadata)
        everyone = group.gather((runs, keys))
        if rank == 0:
            Path(out).write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


def summarize(everyone: list[Any], repeat: int) -> dict[str, Any]:
    out = {}
    for mode in MODES:
        slowest = [max(runs[mode][n][0] for runs, _ in everyone) for n in range(repeat)]
        read = [runs[mode][0][1] for runs, _ in everyone]
        out[mode] = {"slowest_rank_seconds": round(statistics.median(slowest), 4), "bytes_read_per_rank": read,
                     "bytes_read_total": sum(read), "keys": everyone[0][1][mode]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=positive_int, default=512, help="ranks of the simulated save (512: 1.19 M chunks)")
    parser.add_argument("--procs", type=positive_int, default=4, help="gloo processes reading the metadata")
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--out", type=output_file, default=str(RESULTS / "shared_metadata.json"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dcp_ext_shared_md_"))
    try:
        files = write_metadata(workdir / "ckpt", args.ranks)
        result_file = workdir / "result.json"
        mp.spawn(worker, args=(args.procs, free_port(), str(workdir / "ckpt"), args.repeat, str(result_file)),
                 nprocs=args.procs, join=True)
        modes = summarize(json.loads(result_file.read_text()), args.repeat)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert modes["per rank"]["keys"] == modes["shared"]["keys"], modes
    rows = [[mode, fmt(m["slowest_rank_seconds"]), " / ".join(f"{b / 1e6:.1f}" for b in m["bytes_read_per_rank"]),
             f"{m['bytes_read_total'] / 1e6:.1f}"] for mode, m in modes.items()]
    print(f"metadata of a {args.ranks}-rank save: {files['chunks']:,} chunks, .metadata {files['.metadata'] / 1e6:.1f} MB, "
          f"index {files['.dcp_ext_index.parquet'] / 1e6:.1f} MB; {args.procs} processes, median of {args.repeat}")
    print_table("read_metadata on every rank", ["mode", "slowest rank s", "MB read per rank", "MB read in all"], rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"ranks": args.ranks, "procs": args.procs, "files": files, "modes": modes}, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
