"""Save planning and metadata at 64 .. 16,384 ranks, simulated without starting them.

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
assign, metadata), cached (the same save again through the plan cache: key + replica
check), finish (one rank expanding its assignment), metadata write (``ShardWriter.finish``
with synthetic write results: .metadata pickle + our index), metadata load (stock
``FileSystemReader.read_metadata`` = pickle, ``ShardReader.read_metadata`` = index, and
our restricted unpickler). Stock ``DefaultSavePlanner.create_global_plan`` runs on the same
plans (as WriteItems) while ranks x items stays under ``--stock-max-items``.

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
import shutil
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
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_ext import ShardReader, ShardWriter
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.safe_pickle import load_metadata_pickle
from dcp_ext.planning.global_plan import GlobalPlan, check_replicas, plan_globally
from dcp_ext.planning.local_plan import ShardLocalPlan, assigned_items
from dcp_ext.planning.locality import copy_index
from dcp_ext.planning.plan_cache import cached_plan, clear_plan_cache, remember_plan
from dcp_ext.planning.plan_table import BYTE_IO, PlanTable, items_from_table, make_table, table_from_items

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
    ranks: int
    shards: int
    tables: list[PlanTable]  # per rank (replicas share the object)
    digests: list[np.ndarray]
    tp_ranks: list[int]


class TableMaker:
    """Tables per (shard, tp, has param_groups) coordinate, built once and shared across N."""

    def __init__(self, layers: int) -> None:
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
        offsets, sizes = np.zeros((n, 3), np.int64), np.ones((n, 3), np.int64)
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
        for d in range(3):
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
    return Job(ranks, shards, tables, digests, tp_ranks)


# -- measuring --------------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def measured(out: dict, name: str) -> Iterator[None]:
    """Seconds and peak RSS growth (sampled every 5 ms) of the block, into out[name]."""
    gc.collect()
    start_rss, peak, done = rss(), [0], threading.Event()

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
        out[name] = {"seconds": round(seconds, 4), "peak_rss_mb": round(max(peak[0], rss()) - start_rss) / 2**20}


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
    clear_plan_cache()
    with measured(out, "global"):
        result = plan_globally(job.tables, chunk_digests=job.digests, tp_ranks=job.tp_ranks)
    out["global_phases"] = {k: round(v, 4) for k, v in result.seconds.items()}
    out["counts"] = result.counts
    key = (tuple(t.digest for t in job.tables), tuple(job.tp_ranks))
    remember_plan(key, result)
    with measured(out, "cached"):
        hit = cached_plan((tuple(t.digest for t in job.tables), tuple(job.tp_ranks)))
        check_replicas(hit.structure, job.digests, None)
    items = items_from_table(job.tables[1])
    start = time.perf_counter()
    assigned_items(items, result.assignments[1])
    out["finish_plan_seconds_per_rank"] = round(time.perf_counter() - start, 4)
    return result


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
                index = copy_index(index, tp)
            length = int(table.nbytes[row]) + 1100
            stored = StoredItem(f"__{rank}_0123456789ab_{n % 8}.distcp", position[n % 8], length, position[n % 8] + 1024, n)
            position[n % 8] += length
            mine.append(WriteResult(index=index, size_in_bytes=length, storage_data=stored))
        results.append(mine)
    return results


def metadata_round_trip(job: Job, result: GlobalPlan, out: dict, scratch: Path) -> None:
    path = scratch / f"ckpt_{job.ranks}"
    results = write_results(job, result)
    writer = ShardWriter(str(path), sync_files=False)
    writer.set_up_storage_writer(True, rank=0)
    writer.prepare_local_plan(SavePlan([]))
    with measured(out, "metadata_write"):
        writer.finish(dataclasses.replace(result.metadata), results)
    del results
    out["metadata_pickle_bytes"] = (path / ".metadata").stat().st_size
    out["index_bytes"] = (path / ".dcp_ext_index.parquet").stat().st_size
    with measured(out, "load_stock_pickle"):
        FileSystemReader(str(path)).read_metadata()
    with measured(out, "load_our_index"):
        ShardReader(str(path), cache_metadata=False).read_metadata()
    with measured(out, "load_safe_unpickle"):
        load_metadata_pickle((path / ".metadata").read_bytes(), str(path / ".metadata"))
    shutil.rmtree(path)


# -- report -----------------------------------------------------------------------------


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
                f"{meta / 2**20:>12.1f} {r['index_bytes'] / 2**20:>9.1f} {r['load_stock_pickle']['seconds']:>13.2f} {r['load_our_index']['seconds']:>12.2f}"
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
    fig, ax = plt.subplots(figsize=(7, 4.5))
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
        ax.loglog([r["ranks"] for r in hsdp], [r["cached"]["seconds"] for r in hsdp], marker="^", label="dcp_ext cached plan (hsdp)")
    ax.axhline(10, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("ranks")
    ax.set_ylabel("coordinator seconds")
    ax.set_title("Global save planning, ~4,100 items per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 4096, 16384])
    parser.add_argument("--fsdp-ranks", type=int, nargs="*", default=[1024, 2048])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--stock-max-items", type=int, default=2_500_000)
    parser.add_argument("--metadata-max-ranks", type=int, default=16384, help="skip the metadata write/load above this")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_scale.json")
    args = parser.parse_args()
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
                    metadata_round_trip(job, result, out, scratch)
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
