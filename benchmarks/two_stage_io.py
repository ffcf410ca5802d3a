"""Where two-stage loading pays: DP=4 loads of one replicated checkpoint from slow storage.

Every rank of a DP=4 gloo job on CPU loads the same full state dict (plain tensors, so
every rank needs every byte). The plain reader (``ShardReader(url)``) makes each rank read
all of it from storage; the two-stage reader (``ShardReader(url, two_stage=True)``) reads
each byte once per group and sends it to the other ranks over gloo. Which is faster
depends on storage bandwidth against the bandwidth between ranks, so storage here is a
local directory served through ``ThrottledFileSystem``: an fsspec filesystem (protocol
``throttled://``) whose reads take at least bytes / bandwidth seconds. ``--scope client``
gives every rank its own limit (one link to storage per node); ``--scope store`` shares one
limit among all ranks (one storage server). For each limit the two readers run
interleaved, ``--repeat`` times (median); the crossover is the limit where two-stage stops
being faster (interpolated between the two measured limits around it, on a log scale).
The bandwidth between ranks is measured in the same run: an all-gather of the state's
bytes over the same gloo group.

``--s3`` adds the same comparison against moto's S3 server on loopback (moto and s3fs
are test dependencies), storage whose speed is whatever the server manages.

Usage::

    python benchmarks/two_stage_io.py                        # 256 MiB, per-rank limits
    python benchmarks/two_stage_io.py --scope store --s3     # one shared limit; S3 case too
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from io_throughput import Group, fmt, free_port, join_gloo, print_table, timed
from cli_args import output_file, positive_float, positive_int

WORLD = 4
TENSORS = 16
COLS = 1024
MB = 1e6
PROTOCOL = "throttled"
READERS = ("plain", "two_stage")
DEFAULT_LIMITS_MBPS = (25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0)
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "two_stage_io.json"
S3_BUCKET = "dcp-ext-bench"


# ----------------------------------------------------------------------------- throttled store


class BandwidthMeter:
    """Serializes reads through one link of ``bytes_per_s``: each read reserves the next
    ``n / bytes_per_s`` seconds of the link and sleeps until they have passed. ``free_at``
    (a ``multiprocessing.Value('d')``) is when the link is next idle; processes sharing
    it share the link."""

    def __init__(self, bytes_per_s: float, free_at: Any):
        if bytes_per_s <= 0:
            raise ValueError(f"ThrottledFileSystem: bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self.free_at = free_at

    def take(self, n: int) -> None:
        with self.free_at.get_lock():
            now = time.time()  # wall clock: comparable across processes
            done = max(now, self.free_at.value) + n / self.bytes_per_s
            self.free_at.value = done
        time.sleep(max(0.0, done - now))


class ThrottledFile(AbstractBufferedFile):
    """Read-only file whose fetches go through the filesystem's throttled ``cat_file``."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)


class ThrottledFileSystem(fsspec.AbstractFileSystem):
    """A read-only view of the local filesystem whose data reads are rate-limited.

    Storage options: ``bandwidth`` (bytes/s) and ``free_at`` (a shared
    ``multiprocessing.Value('d')``; see ``BandwidthMeter``). Listing and metadata calls
    are free; every byte of ``cat_file`` (and so of ``cat_ranges`` and ``open``) is metered.
    """

    protocol = PROTOCOL
    cachable = False  # every reader gets the meter it was given

    def __init__(self, bandwidth: float, free_at: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.local = LocalFileSystem()
        self.meter = BandwidthMeter(bandwidth, free_at)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        return self.local.ls(self._strip_protocol(path), detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.local.info(self._strip_protocol(path))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        data = self.local.cat_file(self._strip_protocol(path), start, end)
        self.meter.take(len(data))
        return data

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> ThrottledFile:
        if mode != "rb":
            raise PermissionError(f"{PROTOCOL}://{path}: ThrottledFileSystem is read-only (mode {mode!r})")
        return ThrottledFile(self, self._strip_protocol(path), mode, **kwargs)


fsspec.register_implementation(PROTOCOL, ThrottledFileSystem, clobber=True)


# ----------------------------------------------------------------------------- data


def full_state(size_mib: int) -> dict[str, torch.Tensor]:
    """The replicated state dict: TENSORS fp32 matrices, deterministic contents."""
    rows = size_mib * (1 << 20) // TENSORS // 4 // COLS
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, COLS, generator=g) for i in range(TENSORS)}


def garbage_state(size_mib: int) -> dict[str, torch.Tensor]:
    """Destinations of the same shapes, filled with NaN so that a missed byte shows."""
    return {k: torch.full_like(v, float("nan")) for k, v in full_state(size_mib).items()}


def bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in want)


# ----------------------------------------------------------------------------- one job


def load_once(group: Group, reader: ShardReader, size_mib: int, want: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """Wall seconds of one DP load on all ranks, and whether every rank got every bit."""
    state = garbage_state(size_mib)
    seconds = timed(group, lambda: dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner()))
    return seconds, all(group.gather(bit_exact(state, want)))


def exchange_gbps(group: Group, nbytes: int, repeat: int) -> float:
    """Bandwidth between ranks: bytes each rank receives in an all-gather over the group,
    per second (each rank contributes 1/WORLD of ``nbytes`` and receives the rest)."""
    part = torch.ones(nbytes // 4 // group.world, dtype=torch.float32)
    out = [torch.empty_like(part) for _ in range(group.world)]
    dist.all_gather(out, part)  # gloo connects lazily: not part of the figure
    seconds = statistics.median(timed(group, lambda: dist.all_gather(out, part)) for _ in range(repeat))
    return part.nbytes * (group.world - 1) / seconds / 1e9


def job(rank: int, port: int, spec: dict[str, Any], free_at: Any, out: str) -> None:
    """One rank: for each storage case, load with both readers, interleaved, ``repeat`` times."""
    join_gloo(rank, WORLD, port)
    group = Group(rank, WORLD, None)
    try:
        want = full_state(spec["size_mib"])
        result: dict[str, Any] = {"exchange_gbps": exchange_gbps(group, spec["size_mib"] << 20, spec["repeat"]),
                                  "cases": []}
        for case in spec["cases"]:
            options = dict(case["options"])
            if case.get("bandwidth"):
                link = multiprocessing.Value("d", 0.0) if spec["scope"] == "client" else free_at
                options |= {"bandwidth": case["bandwidth"], "free_at": link}
            runs: dict[str, list[float]] = {kind: [] for kind in READERS}
            exact = True
            for _ in range(spec["repeat"]):
                for kind in READERS:
                    reader = ShardReader(case["url"], storage_options=options or None, cache_metadata=False,
                                         two_stage=kind == "two_stage")
                    seconds, ok = load_once(group, reader, spec["size_mib"], want)
                    runs[kind].append(seconds)
                    exact = exact and ok
            result["cases"].append({"label": case["label"], "bandwidth": case.get("bandwidth"),
                                    "seconds": runs, "bit_exact": exact})
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_job(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run ``job`` on WORLD spawned gloo processes; rank 0's result."""
    out = workdir / "result.json"
    free_at = mp.get_context("spawn").Value("d", 0.0)  # the shared link of --scope store
    mp.spawn(job, args=(free_port(), spec, free_at, str(out)), nprocs=WORLD, join=True)
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- S3 on loopback


class LoopbackS3:
    """moto's S3 server on 127.0.0.1 (as the tests start it), with a bucket."""

    def __init__(self) -> None:
        from moto import server as moto_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        port = self.server.get_host_and_port()[1]
        self.options = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-west-2"}}
        fsspec.filesystem("s3", **self.options).mkdir(S3_BUCKET)

    def stop(self) -> None:
        self.server.stop()


# ----------------------------------------------------------------------------- report


def crossover(rows: list[dict[str, Any]]) -> float | None:
    """The bandwidth (MB/s) where two-stage stops being faster than plain, interpolated in
    log bandwidth between the two limits around it; None if it never flips in the range."""
    points = [(r["bandwidth_mbps"], math.log(r["two_stage/plain"])) for r in rows if r["bandwidth_mbps"]]
    points.sort()
    for (b0, y0), (b1, y1) in zip(points, points[1:]):
        if y0 < 0 <= y1:
            t = -y0 / (y1 - y0)
            return math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0)))
    return None


def summarize(result: dict[str, Any], size_bytes: int) -> list[dict[str, Any]]:
    rows = []
    for case in result["cases"]:
        plain, two = (statistics.median(case["seconds"][kind]) for kind in READERS)
        rows.append({"label": case["label"], "bandwidth_mbps": case["bandwidth"] and case["bandwidth"] / MB,
                     "plain_s": plain, "two_stage_s": two, "two_stage/plain": two / plain,
                     "plain_gbps": size_bytes * WORLD / plain / 1e9, "two_stage_gbps": size_bytes * WORLD / two / 1e9,
                     "seconds": case["seconds"], "bit_exact": case["bit_exact"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=positive_int, default=256, help="replicated state size (default 256)")
    parser.add_argument("--limits", type=positive_float, nargs="+", default=list(DEFAULT_LIMITS_MBPS),
                        help="storage bandwidth limits in MB/s (1e6 bytes)")
    parser.add_argument("--scope", choices=("client", "store"), default="client",
                        help="a limit per rank (client) or one shared by all ranks (store)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="loads per reader and case; the median is reported")
    parser.add_argument("--s3", action="store_true", help="also load from moto's S3 server on loopback")
    parser.add_argument("--s3-size-mib", type=positive_int, default=64, help="state size for the S3 case (default 64)")
    parser.add_argument("--json", type=output_file, default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="dcp_ext_two_stage_"))
    size_bytes = sum(t.nbytes for t in full_state(args.size_mib).values())
    res: dict[str, Any] = {"world": WORLD, "size_bytes": size_bytes, "scope": args.scope, "repeat": args.repeat,
                           "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}
    started = time.perf_counter()
    try:
        path = workdir / "ckpt"
        dcp.save(full_state(args.size_mib), storage_writer=ShardWriter(path), planner=ShardSavePlanner(), no_dist=True)
        cases = [{"label": "local disk (page cache), no limit", "url": str(path), "options": {}}]
        cases += [{"label": f"{PROTOCOL}:// {b:g} MB/s", "url": f"{PROTOCOL}://{path}", "options": {},
                   "bandwidth": b * MB} for b in sorted(args.limits)]
        spec = {"size_mib": args.size_mib, "repeat": args.repeat, "scope": args.scope, "cases": cases}
        print(f"[two_stage_io] DP={WORLD}, {size_bytes / 1e6:.0f} MB, {len(cases)} storage cases", file=sys.stderr)
        result = run_job(spec, workdir)
        res["exchange_gbps"] = result["exchange_gbps"]
        res["rows"] = summarize(result, size_bytes)
        res["crossover_mbps"] = crossover(res["rows"])
        if args.s3:
            res["s3"] = s3_case(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - started
    res["loadavg_at_end"] = os.getloadavg()
    report(res)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2))
    print(f"results: {args.json}")


def s3_case(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Both readers against moto's S3 server on loopback (the server runs in this process)."""
    s3 = LoopbackS3()
    try:
        url = f"s3://{S3_BUCKET}/ckpt"
        dcp.save(full_state(args.s3_size_mib), storage_writer=ShardWriter(url, storage_options=s3.options),
                 planner=ShardSavePlanner(), no_dist=True)
        spec = {"size_mib": args.s3_size_mib, "repeat": args.repeat, "scope": "client",
                "cases": [{"label": "S3 (moto, loopback)", "url": url, "options": s3.options}]}
        result = run_job(spec, workdir)
    finally:
        s3.stop()
    size_bytes = sum(t.nbytes for t in full_state(args.s3_size_mib).values())
    return {"size_bytes": size_bytes, "exchange_gbps": result["exchange_gbps"], "rows": summarize(result, size_bytes)}


def report(res: dict[str, Any]) -> None:
    def table(title: str, rows: list[dict[str, Any]]) -> None:
        print_table(title, ["storage", "plain s", "two-stage s", "two-stage/plain", "faster", "bit-exact"],
                    [[r["label"], fmt(r["plain_s"], ".3f"), fmt(r["two_stage_s"], ".3f"), fmt(r["two_stage/plain"]),
                      "two-stage" if r["two_stage/plain"] < 1 else "plain", str(r["bit_exact"])] for r in rows])

    table(f"DP={WORLD} load of {res['size_bytes'] / 1e6:.0f} MB per rank, storage limit per "
          f"{'rank' if res['scope'] == 'client' else 'store (shared by all ranks)'}, median of {res['repeat']}",
          res["rows"])
    cross = res["crossover_mbps"]
    print(f"\nbetween ranks (gloo all-gather, bytes received per rank): {res['exchange_gbps'] * 1e3:.0f} MB/s")
    print("crossover: " + (f"two-stage is faster below ~{cross:.0f} MB/s of storage bandwidth" if cross else
                           "no crossover within the limits measured"))
    if "s3" in res:
        table(f"DP={WORLD} load of {res['s3']['size_bytes'] / 1e6:.0f} MB per rank from S3 on loopback",
              res["s3"]["rows"])
    print(f"load average at start/end: {res['loadavg_at_start'][0]:.1f}/{res['loadavg_at_end'][0]:.1f} "
          f"on {res['cpus']} CPUs; wall {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
