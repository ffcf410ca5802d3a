"""Save and load planning and metadata at 64 .. 16,384 ranks, simulated without starting them.

    python benchmarks/plan_scale.py                  # N = 64 512 4096 16384, ~10 min
    python benchmarks/plan_scale.py --ranks 64 512   # quicker

The model: a 64-layer MoE transformer (every other layer 64 experts plus a shared expert,
QK-norm, biased QKV), 1,027 parameters; AdamW state (exp_avg, exp_avg_sq, a scalar step per
parameter) and param_groups on rank 0: 4,108 items per rank (4,109 on rank 0), fp32.

The layout (TorchTitan-style HSDP x TP x EP): mesh (replicate, shard, tp) with tp = 8,
shard = min(64, N / 8), replicate = N / (8 * shard). Column-parallel weights split dim 0
over tp x shard, row-parallel ones dim 1 over tp and dim 0 over shard, norms and the router
are TP-replicated and FSDP-sharded, experts split dim 0 (EP over the tp dim) and dim 1 over
shard, steps are 0-dim tensors on every rank. A second scenario, ``fsdp`` (shard = N / 8,
no replication: every rank's plan differs), shows growth in ranks x items when nothing
repeats (``--fsdp-ranks``).

Per rank the tables are built as a rank would build them (``table_from_items`` on DCP's
WriteItems gives the same digest; checked for two ranks), with a chunk digest per row as
for ``check_replicas`` and the TP coordinate for ``replica_locality``; replicas share one
table object here (on a real coordinator they arrive as equal copies; the bytes that
travel are reported as gather bytes). Phases: local (encoding one rank's table), global
(``plan_globally``: group, concat, sort, validate, replica check, balance, locality,
assign, metadata, then the replica units of each group), cached (a save of the same
layout: the coordinator's part of the digest exchange, the plan cache lookup and the
per-class replica check over every rank's hashes), save gather (pickled local plans: the
first save, every distinct table sent once, and an unchanged layout, digest and class
hashes only), finish (one rank expanding its assignment), metadata write
(``ShardWriter.finish`` with synthetic write results: .metadata pickle + our index).

Load side (HSDP only): one rank (rank 1, loading the shards it saved) in a fresh child
process, so its memory is its own: ``ShardReader.read_metadata`` + the local plan from
the index's columns (``load_plan.tensor_reads``, as ReadItems), against stock
``FileSystemReader.read_metadata`` + DCP's ``create_read_items_for_chunk_list``; the
coordinator's load step for N ranks (N empty ShardLoadPlanner plans unpickled, DCP's and
the reader's global step, pickled back), against stock's, extrapolated from one rank's
ReadItem plan pickled and unpickled. Stock ``DefaultSavePlanner.create_global_plan`` runs
on the same plans (as WriteItems) while ranks x items stays under ``--stock-max-items``.

Writes benchmarks/results/plan_scale.json and plan_scale.png (needs matplotlib:
``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem, SavePlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from dcp_ext import ShardLoadPlanner, ShardReader, ShardWriter
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.replica_copy import ReplicaCopyIndex
from dcp_ext.planning.digest_exchange import first_senders
from dcp_ext.planning.global_plan import GlobalPlan, plan_globally
from dcp_ext.planning.load_plan import tensor_reads
from dcp_ext.planning.local_plan import ShardLocalPlan, assigned_items
from dcp_ext.planning.plan_cache import cached_plan, clear_plan_cache, plan_id, plan_key, remember_plan
from dcp_ext.planning.replica_units import check_units, unit_hashes, with_units
from dcp_ext.planning.plan_table import BYTE_IO, PlanTable, items_from_table, make_table, table_from_items
from cli_args import output_file, positive_int

RESULTS = Path(__file__).parent / "results"
TP = 8
H, KV, F, DH, E, FE, FS, V = 8192, 1024, 28672, 128, 64, 2048, 2048, 131072
FP32 = TensorProperties(dtype=torch.float32)
SHARD_GROUP = 64


# -- the simulated job ------------------------------------------------------------------


def model_specs(layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, layout) per parameter; layouts: col, row, rep, expert."""
    specs = [("tok_embeddings.weight", (V, H), "col")]
    for layer in range(layers):
        p = f"layers.{layer}."
        specs += [
            (p + "attention_norm.weight", (H,), "rep"),
            (p + "attention.wq.weight", (H, H), "col"),
            (p + "attention.wq.bias", (H,), "col"),
            (p + "attention.wk.weight", (KV, H), "col"),
            (p + "attention.wk.bias", (KV,), "col"),
            (p + "attention.wv.weight", (KV, H), "col"),
            (p + "attention.wv.bias", (KV,), "col"),
            (p + "attention.wo.weight", (H, H), "row"),
            (p + "attention.q_norm.weight", (DH,), "rep"),
            (p + "attention.k_norm.weight", (DH,), "rep"),
            (p + "ffn_norm.weight", (H,), "rep"),
        ]
        if layer % 2 == 0:
            specs += [(p + "mlp.w1.weight", (F, H), "col"), (p + "mlp.w3.weight", (F, H), "col"), (p + "mlp.w2.weight", (H, F), "row")]
        else:
            specs += [
                (p + "moe.router.weight", (E, H), "rep"),
                (p + "moe.experts.w1", (E, FE, H), "expert"),
                (p + "moe.experts.w3", (E, FE, H), "expert"),
                (p + "moe.experts.w2", (E, H, FE), "expert"),
                (p + "moe.shared.w1.weight", (FS, H), "col"),
                (p + "moe.shared.w3.weight", (FS, H), "col"),
                (p + "moe.shared.w2.weight", (H, FS), "row"),
            ]
    return specs + [("norm.weight", (H,), "rep"), ("output.weight", (V, H), "col")]


def split(extent: int, parts: int, part: int) -> tuple[int, int]:
    """(offset, size) of ``part`` when ``extent`` is split like torch's Shard: ceil-sized
    pieces, the last ones smaller or empty."""
    step = -(-extent // parts)
    offset = min(part * step, extent)
    return offset, min(step, extent - offset)


def chunk(shape: tuple[int, ...], layout: str, s: int, t: int, shards: int) -> tuple[list[int], list[int]]:
    off, size = [0] * len(shape), list(shape)
    if layout == "col":
        off[0], size[0] = split(shape[0], TP * shards, t * shards + s)
    elif layout == "row":
        off[0], size[0] = split(shape[0], shards, s)
        off[1], size[1] = split(shape[1], TP, t)
    elif layout == "rep":
        off[0], size[0] = split(shape[0], shards, s)
    else:  # expert: EP over the tp dim, FSDP over dim 1
        off[0], size[0] = split(shape[0], TP, t)
        off[1], size[1] = split(shape[1], shards, s)
    return off, size


@dataclasses.dataclass
class Job:
    layers: int
    ranks: int
    shards: int
    tables: list[PlanTable]  # per rank (replicas share the object)
    digests: list[np.ndarray]
    tp_ranks: list[int]


class TableMaker:
    """Tables per (shard, tp, has param_groups) coordinate, built once and shared across N."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        params = model_specs(layers)
        self.entries = []  # (fqn, shape, layout or None for scalars)
        for name, shape, layout in params:
            self.entries.append((f"model.{name}", shape, layout))
        for name, shape, layout in params:
            for state in ("exp_avg", "exp_avg_sq"):
                self.entries.append((f"optim.state.{name}.{state}", shape, layout))
            self.entries.append((f"optim.state.{name}.step", (), None))
        self.fqns = tuple(e[0] for e in self.entries)
        self.facts = tuple((FP32, torch.Size(e[1])) for e in self.entries)
        self.cache: dict[tuple[int, int, int, bool], tuple[PlanTable, np.ndarray]] = {}

    def table(self, s: int, t: int, shards: int, rank0: bool) -> tuple[PlanTable, np.ndarray]:
        key = (s, t, shards, rank0)
        if key not in self.cache:
            self.cache[key] = self._build(s, t, shards, rank0)
        return self.cache[key]

    def _build(self, s: int, t: int, shards: int, rank0: bool) -> tuple[PlanTable, np.ndarray]:
        n = len(self.entries) + int(rank0)
        width = max(len(shape) for _, shape, _ in self.entries)  # as a rank's table: its widest box (no 3-D experts at one layer)
        offsets, sizes = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
        kind, ndim, nbytes = np.full(n, WriteItemType.SHARD.value, np.int8), np.zeros(n, np.int8), np.zeros(n, np.int64)
        for row, (_, shape, layout) in enumerate(self.entries):
            if layout is None:
                kind[row], nbytes[row] = WriteItemType.TENSOR.value, 4
                continue
            off, size = chunk(shape, layout, s, t, shards)
            offsets[row, : len(off)], sizes[row, : len(size)] = off, size
            ndim[row], nbytes[row] = len(shape), 4 * math.prod(size)
        fqns, facts = self.fqns, self.facts
        fqn_id = np.arange(n)
        if rank0:
            fqns, facts = fqns + ("optim.param_groups",), facts + (None,)
            kind[-1] = BYTE_IO
        table = make_table(fqns, facts, fqn_id, kind, ndim, offsets, sizes, nbytes)
        # a digest per chunk as ranks would send: equal wherever the chunk is equal
        mix = (fqn_id.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        for d in range(width):
            mix ^= offsets[:, d].astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F + d)
        digests = np.stack([mix | np.uint64(1), mix * np.uint64(31) | np.uint64(1)], axis=1)
        digests[kind == BYTE_IO] = 0
        return table, digests


def make_job(maker: TableMaker, ranks: int, scenario: str) -> Job:
    shards = ranks // TP if scenario == "fsdp" else min(SHARD_GROUP, ranks // TP)
    tables, digests, tp_ranks = [], [], []
    for rank in range(ranks):
        s, t = (rank // TP) % shards, rank % TP
        table, digest = maker.table(s, t, shards, rank == 0)
        tables.append(table)
        digests.append(digest.copy())  # every rank sends its own
        tp_ranks.append(t)
    return Job(maker.layers, ranks, shards, tables, digests, tp_ranks)


# -- measuring --------------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def measured(out: dict, name: str) -> Iterator[None]:
    """Seconds, CPU seconds in user and kernel mode (the kernel's share is mostly page
    faults on fresh memory) and peak RSS growth (sampled every 5 ms) of the block, into
    out[name]."""
    gc.collect()
    start_rss = rss()
    peak, done = [start_rss], threading.Event()  # growth, never below 0 when memory is freed during the block
    start_cpu = resource.getrusage(resource.RUSAGE_SELF)

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        out[name] = {
            "seconds": round(seconds, 4),
            "user_seconds": round(cpu.ru_utime - start_cpu.ru_utime, 2),
            "system_seconds": round(cpu.ru_stime - start_cpu.ru_stime, 2),
            "peak_rss_mb": round((max(peak[0], rss()) - start_rss) / 2**20, 1),
        }


def local_costs(job: Job, out: dict) -> None:
    """One rank's own work: encode its table (from DCP WriteItems) and expand its assignment."""
    table = job.tables[1]
    items = items_from_table(table)
    start = time.perf_counter()
    again = table_from_items(items)
    out["local_encode_seconds"] = round(time.perf_counter() - start, 4)
    assert again.digest == table.digest, "simulated table differs from what a rank would build"
    plan = ShardLocalPlan(items=[], table=table, chunk_digests=job.digests[1], tp_rank=job.tp_ranks[1])
    out["gather_bytes_per_rank"] = len(pickle.dumps(plan))
    out["stock_gather_bytes_per_rank"] = len(pickle.dumps(SavePlan(items)))


def run_ours(job: Job, out: dict) -> GlobalPlan:
    """A first save (tables sent, plan made, replica units attached) and a save of the same
    layout (digests and one hash per replica class sent, plan reused)."""
    clear_plan_cache()
    key = plan_key([t.digest for t in job.tables], job.tp_ranks)
    with measured(out, "global"):
        result = plan_globally(job.tables, chunk_digests=job.digests, tp_ranks=job.tp_ranks)
    out["global_phases"] = {k: round(v, 4) for k, v in result.seconds.items()}
    start = time.perf_counter()
    result = with_units(result, plan_id(key))
    out["global_phases"]["replica_units"] = round(time.perf_counter() - start, 4)
    out["counts"] = result.counts
    remember_plan(key, result)
    hashes = unchanged_layout_hashes(job, result)
    with measured(out, "cached"):
        digests = [t.digest for t in job.tables]
        first_senders(digests, {})  # the coordinator's part of the digest exchange
        hit = cached_plan(plan_key(digests, job.tp_ranks))
        check_units(hit, hashes, None)
    save_gather(job, result, hashes, out)
    items = items_from_table(job.tables[1])
    start = time.perf_counter()
    assigned_items(items, result.assignments[1])
    out["finish_plan_seconds_per_rank"] = round(time.perf_counter() - start, 4)
    return result


def unchanged_layout_hashes(job: Job, result: GlobalPlan) -> list[np.ndarray]:
    """Each rank's replica-class hashes for the cached plan (computed once per distinct
    table: replicas here share one digest array)."""
    by_table: dict[int, np.ndarray] = {}
    out = []
    for rank, (table, digests) in enumerate(zip(job.tables, job.digests)):
        key = id(table)
        if key not in by_table:
            by_table[key] = unit_hashes(digests, result.assignments[rank].units)
        out.append(by_table[key])
    return out


def save_gather(job: Job, result: GlobalPlan, hashes: list[np.ndarray], out: dict) -> None:
    """Bytes gathered by the coordinator per save: the first (every distinct table once, as
    the digest exchange asks) and one of an unchanged layout (digests and class hashes)."""
    sample = sorted({0, 1, job.ranks // 2, job.ranks - 1})
    unchanged = []
    for rank in sample:
        plan = ShardLocalPlan(items=[], table=None, table_digest=job.tables[rank].digest, unit_hashes=hashes[rank], tp_rank=job.tp_ranks[rank])
        unchanged.append(len(pickle.dumps(plan)))
    sizes: dict[int, int] = {}
    first_total = 0
    for rank, table in enumerate(job.tables):
        if id(table) not in sizes:
            full = ShardLocalPlan(items=[], table=table, table_digest=table.digest, chunk_digests=job.digests[rank], tp_rank=job.tp_ranks[rank])
            sizes[id(table)] = len(pickle.dumps(full))
            first_total += sizes[id(table)]
        else:  # a replica of a table another rank sends: digest and chunk digests only
            first_total += len(pickle.dumps(ShardLocalPlan(items=[], table=None, table_digest=table.digest, chunk_digests=job.digests[rank], tp_rank=job.tp_ranks[rank])))
    exchange = len(pickle.dumps(bytes(26)))  # the all-gathered record per rank
    out["save_gather"] = {
        "unchanged_bytes_per_rank_max": max(unchanged),
        "unchanged_bytes_total": int(np.mean(unchanged) * job.ranks),
        "exchange_record_bytes": exchange,
        "exchange_broadcast_bytes": len(pickle.dumps((bytes(16), np.packbits(np.ones(job.ranks, bool)).tobytes()))),
        "first_save_bytes_total": first_total,
        "before_bytes_total": sum(sizes[id(t)] for t in job.tables),  # every rank sending its table (before the exchange)
        "replica_units_per_rank_max": max(len(h) for h in hashes),
    }


def run_stock(job: Job, out: dict, max_items: int) -> None:
    total = sum(len(t) for t in job.tables)
    if total > max_items:
        out["stock"] = {"skipped": f"{total:,} WriteItems > --stock-max-items {max_items:,}"}
        return
    plans = [SavePlan(items_from_table(t)) for t in job.tables]
    stock: dict = {}
    with measured(stock, "global"):
        DefaultSavePlanner(flatten_state_dict=False).create_global_plan(plans)
    out["stock"] = stock["global"]
    del plans
    gc.collect()


def write_results(job: Job, result: GlobalPlan) -> list[list[WriteResult]]:
    """Synthetic write results for the plan: 8 files per rank, records back to back."""
    results = []
    for rank, assignment in enumerate(result.assignments):
        table = job.tables[rank]
        rows = np.concatenate([assignment.rows, assignment.copy_rows]).tolist()
        copies = [None] * len(assignment.rows) + assignment.copy_tp.tolist()
        hints = assignment.hints.tolist() + [0] * len(assignment.copy_rows)
        position = [0] * 8
        mine = []
        for n, (row, tp, hint) in enumerate(zip(rows, copies, hints)):
            fqn, nd = table.fqns[table.fqn_id[row]], int(table.ndim[row])
            index = MetadataIndex(fqn, table.offsets[row, :nd].tolist() if table.kind[row] != BYTE_IO else None, hint)
            if tp is not None:
                index = ReplicaCopyIndex.of(index, tp)
            length = int(table.nbytes[row]) + 1100
            stored = StoredItem(f"__{rank}_0123456789ab_{n % 8}.distcp", position[n % 8], length, position[n % 8] + 1024, n)
            position[n % 8] += length
            mine.append(WriteResult(index=index, size_in_bytes=length, storage_data=stored))
        results.append(mine)
    return results


def coordinator_writer(path: Path, results: list[list[WriteResult]]) -> ShardWriter:
    """A ShardWriter set up as the coordinator of a save, ready for ``finish`` of
    ``results``: their data files exist, empty (the commit checks that every data file
    it references is there)."""
    writer = ShardWriter(str(path), sync_files=False)
    writer.set_up_storage_writer(True, rank=0)
    writer.prepare_local_plan(SavePlan([]))
    for name in {written.storage_data.relative_path for mine in results for written in mine}:
        (path / name).touch()
    return writer


def metadata_round_trip(job: Job, result: GlobalPlan, out: dict, scratch: Path, stock_load: bool) -> None:
    path = scratch / f"ckpt_{job.ranks}"
    results = write_results(job, result)
    writer = coordinator_writer(path, results)
    with measured(out, "metadata_write"):
        writer.finish(dataclasses.replace(result.metadata), results)
    del results
    out["metadata_pickle_bytes"] = (path / ".metadata").stat().st_size
    out["index_bytes"] = (path / ".dcp_ext_index.parquet").stat().st_size
    os.sync()  # the probes time a rank's read, not the writeback of the files just written
    with measured(out, "load_our_index"):
        ShardReader(str(path), cache_metadata=False).read_metadata()
    out["load_rank"] = probe(path, job, "ours", repeat=PROBE_REPEAT)
    if stock_load:
        out["load_rank_stock"] = probe(path, job, "stock")
    coordinator_load(job, out)
    shutil.rmtree(path)


# -- load side --------------------------------------------------------------------------


PROBE_RANK = 1
PROBE_REPEAT = 5  # ours; stock's probe takes ~12 s a run at a million chunks and runs once


def probe(path: Path, job: Job, kind: str, repeat: int = 1) -> dict:
    """One rank's load planning in a fresh process (so its memory is its own): metadata
    read + local plan for the shards rank PROBE_RANK holds, ours or stock. With ``repeat``,
    the run of median time, with every run's seconds beside it (a fresh process on a
    shared box varies by 20-30%)."""
    command = [sys.executable, __file__, "--probe", kind, "--probe-path", str(path), "--probe-shards", str(job.shards), "--layers", str(job.layers)]
    runs = []
    for _ in range(repeat):
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    runs.sort(key=lambda run: run["metadata_and_plan"]["seconds"])
    return {**runs[len(runs) // 2], "runs_seconds": [run["metadata_and_plan"]["seconds"] for run in runs]}


def rank_chunks(table: PlanTable) -> dict[str, ChunkStorageMetadata]:
    """The local chunk of every tensor key a rank holds (from its save table: it loads what it saved)."""
    out = {}
    for fqn_id, kind, ndim, off, size in zip(table.fqn_id.tolist(), table.kind.tolist(), table.ndim.tolist(), table.offsets.tolist(), table.sizes.tolist()):
        if kind != BYTE_IO:
            out[table.fqns[fqn_id]] = ChunkStorageMetadata(torch.Size(off[:ndim]), torch.Size(size[:ndim]))
    return out


def run_probe(kind: str, path: str, shards: int, layers: int) -> None:
    maker = TableMaker(layers)
    s, t = (PROBE_RANK // TP) % shards, PROBE_RANK % TP
    chunks = rank_chunks(maker.table(s, t, shards, False)[0])
    out: dict = {}
    with measured(out, "metadata_and_plan"):
        start, read_before = time.perf_counter(), bytes_read()
        if kind == "ours":
            metadata = ShardReader(path, cache_metadata=False).read_metadata()
            out["metadata_seconds"] = round(time.perf_counter() - start, 4)
            out["metadata_bytes_read"] = bytes_read() - read_before
            keys = metadata.state_dict_metadata
            items = tensor_reads(keys, [(fqn, 0, chunk) for fqn, chunk in chunks.items() if keys.facts(fqn) is not None]).read_items()
        else:
            metadata = FileSystemReader(path).read_metadata()
            out["metadata_seconds"] = round(time.perf_counter() - start, 4)
            out["metadata_bytes_read"] = bytes_read() - read_before
            state = metadata.state_dict_metadata
            items = [item for fqn, chunk in chunks.items() for item in create_read_items_for_chunk_list(fqn, state[fqn], [chunk])]
    out["plan_seconds"] = round(out["metadata_and_plan"]["seconds"] - out["metadata_seconds"], 4)
    out["read_items"] = len(items)
    out["local_plan_bytes"] = len(pickle.dumps(LoadPlan(items)))
    print(json.dumps(out))


def bytes_read() -> int:
    """Bytes this process has read through read calls so far (page-cache hits included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def coordinator_load(job: Job, out: dict) -> None:
    """DCP's load plan round trip through the coordinator at N ranks: ShardLoadPlanner's
    empty plans unpickled (gather), DCP's global load step and the reader's, pickled back
    (scatter). Stock: one rank's plan of ReadItems, its pickle round trip timed on a few
    copies and scaled to N (16 GB of messages at 16,384 ranks is not run)."""
    message = pickle.dumps(LoadPlan([]))
    planner, reader = ShardLoadPlanner(), ShardReader("unused")
    with measured(out, "load_coordinator"):
        plans = [pickle.loads(message) for _ in range(job.ranks)]
        plans = reader.prepare_global_plan(planner.create_global_plan(plans))
        back = [pickle.dumps(plan) for plan in plans]
    stock_items = out["load_rank"]["local_plan_bytes"]
    out["load_gather_bytes_per_rank"] = len(message)
    out["load_scatter_bytes_per_rank"] = max(len(b) for b in back)
    out["stock_load_gather_bytes_per_rank"] = stock_items
    stock_plan = pickle.dumps(stock_rank_plan(job))
    start = time.perf_counter()
    for _ in range(4):
        pickle.dumps(pickle.loads(stock_plan))
    out["stock_load_coordinator_seconds_extrapolated"] = round((time.perf_counter() - start) / 4 * job.ranks, 2)


def stock_rank_plan(job: Job) -> LoadPlan:
    """The ReadItems DCP's default planner makes for rank PROBE_RANK (no resharding: one per chunk)."""
    items = items_from_table(job.tables[PROBE_RANK])
    return LoadPlan([
        ReadItem(LoadItemType.TENSOR, item.index, torch.Size([0] * len(item.index.offset)), item.index, torch.Size([0] * len(item.index.offset)), item.tensor_data.chunk.sizes)
        for item in items if item.tensor_data is not None
    ])


# -- report -----------------------------------------------------------------------------


def targets(rows: list[dict]) -> dict:
    """The issue's targets against this run's figures (None: the case was not run)."""
    loads = [r for r in rows if r["scenario"] == "hsdp" and "load_rank" in r and r["counts"]["unique_chunks"] >= 1_000_000]
    widest = max((r for r in rows if r["scenario"] == "hsdp" and "load_coordinator" in r), key=lambda r: r["ranks"], default=None)
    fsdp = [r for r in rows if r["scenario"] == "fsdp" and r["ranks"] >= 16384]
    found = {
        "rank_load_seconds": (max((r["load_rank"]["metadata_and_plan"]["seconds"] for r in loads), default=None), 0.5),
        "rank_load_peak_mb": (max((r["load_rank"]["metadata_and_plan"]["peak_rss_mb"] for r in loads), default=None), 200),
        "coordinator_load_seconds": (None if widest is None or widest["ranks"] < 16384 else widest["load_coordinator"]["seconds"], 2.0),
        "unchanged_save_gather_bytes_per_rank": (max((r["save_gather"]["unchanged_bytes_per_rank_max"] for r in rows), default=None), 4096),
        "fsdp_16384_save_plan_seconds": (
            max((r["global"]["seconds"] + r["global_phases"]["replica_units"] for r in fsdp), default=None), 30.0
        ),
    }
    out = {}
    for name, (value, limit) in found.items():
        verdict = "not run" if value is None else "met" if value <= limit else "missed"
        out[name] = {"value": value, "target": limit, "verdict": verdict}
        print(f"target {name}: {value} <= {limit}: {verdict}")
    return out


def slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    return round(float(np.polyfit(np.log(xs), np.log(ys), 1)[0]), 3)


def print_table(rows: list[dict]) -> None:
    head = f"{'scenario':8} {'ranks':>6} {'rank rows':>11} {'distinct':>8} {'chunks':>9} {'global s':>9} {'cached s':>9} {'stock s':>9} {'peak MB':>8} {'.metadata MB':>12} {'index MB':>9} {'pickle load s':>13} {'index load s':>12}"
    print(head)
    for r in rows:
        stock = r.get("stock", {})
        stock_s = f"{stock['seconds']:.2f}" if "seconds" in stock else "skipped"
        meta = r.get("metadata_pickle_bytes")
        print(
            f"{r['scenario']:8} {r['ranks']:>6} {r['counts']['rank_rows']:>11,} {r['counts']['distinct_tables']:>8} "
            f"{r['counts']['unique_chunks']:>9,} {r['global']['seconds']:>9.2f} {r['cached']['seconds']:>9.3f} {stock_s:>9} "
            f"{r['global']['peak_rss_mb']:>8.0f} "
            + (
                f"{meta / 2**20:>12.1f} {r['index_bytes'] / 2**20:>9.1f} {r.get('load_rank_stock', {}).get('metadata_seconds', float('nan')):>13.2f} {r['load_our_index']['seconds']:>12.2f}"
                if meta
                else f"{'-':>12} {'-':>9} {'-':>13} {'-':>12}"
            )
        )


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    fig, (ax, load_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for scenario, marker in (("hsdp", "o"), ("fsdp", "s")):
        mine = [r for r in rows if r["scenario"] == scenario]
        if not mine:
            continue
        ax.loglog([r["ranks"] for r in mine], [r["global"]["seconds"] for r in mine], marker=marker, label=f"dcp_ext global plan ({scenario})")
        stock = [r for r in mine if "seconds" in r.get("stock", {})]
        if stock:
            ax.loglog([r["ranks"] for r in stock], [r["stock"]["seconds"] for r in stock], marker=marker, linestyle="--", label=f"stock DefaultSavePlanner ({scenario})")
    hsdp = [r for r in rows if r["scenario"] == "hsdp"]
    if hsdp:
        ax.loglog([r["ranks"] for r in hsdp], [r["cached"]["seconds"] for r in hsdp], marker="^", label="dcp_ext unchanged layout (hsdp)")
    ax.axhline(10, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("ranks")
    ax.set_ylabel("coordinator seconds")
    ax.set_title("Save planning, ~4,100 items per rank")
    ax.legend(fontsize=8)
    loads = [r for r in hsdp if "load_rank" in r]
    if loads:
        n = [r["ranks"] for r in loads]
        load_ax.loglog(n, [r["load_rank"]["metadata_and_plan"]["seconds"] for r in loads], marker="o", label="dcp_ext per rank: metadata + local plan")
        stock = [r for r in loads if "load_rank_stock" in r]
        if stock:
            load_ax.loglog([r["ranks"] for r in stock], [r["load_rank_stock"]["metadata_and_plan"]["seconds"] for r in stock], marker="o", linestyle="--", label="stock per rank: .metadata + DCP local plan")
        load_ax.loglog(n, [max(r["load_coordinator"]["seconds"], 1e-4) for r in loads], marker="^", label="dcp_ext coordinator load step")
        load_ax.loglog(n, [r["stock_load_coordinator_seconds_extrapolated"] for r in loads], marker="^", linestyle="--", label="stock coordinator load step (extrapolated)")
        load_ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        load_ax.set_xlabel("ranks")
        load_ax.set_ylabel("seconds")
        load_ax.set_title("Load planning (HSDP layout)")
        load_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=positive_int, nargs="+", default=[64, 512, 4096, 16384])
    parser.add_argument("--fsdp-ranks", type=positive_int, nargs="*", default=[1024, 2048])
    parser.add_argument("--layers", type=positive_int, default=64)
    parser.add_argument("--stock-max-items", type=positive_int, default=2_500_000)
    parser.add_argument("--metadata-max-ranks", type=positive_int, default=16384, help="skip the metadata write/load above this")
    parser.add_argument("--stock-load-max-ranks", type=positive_int, default=16384, help="skip the stock per-rank load probe above this")
    parser.add_argument("--out", type=output_file, default=str(RESULTS / "plan_scale.json"))
    parser.add_argument("--probe", choices=("ours", "stock"), help=argparse.SUPPRESS)  # one rank's load, in a child process
    parser.add_argument("--probe-path", help=argparse.SUPPRESS)
    parser.add_argument("--probe-shards", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        run_probe(args.probe, args.probe_path, args.probe_shards, args.layers)
        return
    maker = TableMaker(args.layers)
    rows: list[dict] = []
    scratch = Path(tempfile.mkdtemp(prefix="plan_scale_", dir=os.environ.get("PLAN_SCALE_DIR")))
    try:
        for scenario, sizes in (("hsdp", args.ranks), ("fsdp", args.fsdp_ranks)):
            for ranks in sizes:
                job = make_job(maker, ranks, scenario)
                out: dict = {"scenario": scenario, "ranks": ranks, "shard_group": job.shards}
                local_costs(job, out)
                run_stock(job, out, args.stock_max_items)
                result = run_ours(job, out)
                if scenario == "hsdp" and ranks <= args.metadata_max_ranks:
                    metadata_round_trip(job, result, out, scratch, stock_load=ranks <= args.stock_load_max_ranks)
                rows.append(out)
                print(json.dumps(out), flush=True)
                del job, result
                clear_plan_cache()
                gc.collect()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for scenario in ("hsdp", "fsdp"):
        mine = [r for r in rows if r["scenario"] == scenario]
        exponent = slope([r["counts"]["rank_rows"] for r in mine], [r["global"]["seconds"] for r in mine])
        print(f"{scenario}: global-plan seconds grow as (ranks x items)^{exponent}")
    print_table(rows)
    summary = {
        "rows": rows,
        "targets": targets(rows),
        "growth_exponent_vs_rank_items": {
            s: slope([r["counts"]["rank_rows"] for r in rows if r["scenario"] == s], [r["global"]["seconds"] for r in rows if r["scenario"] == s])
            for s in ("hsdp", "fsdp")
        },
        "layers": args.layers,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"results: {args.out}")
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
