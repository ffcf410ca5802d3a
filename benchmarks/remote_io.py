"""Loads from an object store: stock DCP ``FsspecReader`` versus ``ShardReader``, on the same
checkpoints, in one run.

moto's S3 server runs in a process of its own on loopback (in the loading process its
request handling would hold the GIL the loads need). A deterministic state dict (default
120 fp32 tensors of 256 KiB and 4 MiB, ~150 MB) is saved twice: by stock ``FsspecWriter``
(one file for the process, stock's default, or with ``--file-per-item`` one object per
tensor) and by ``ShardWriter``. Each reader loads each checkpoint into NaN-filled tensors,
all cases interleaved, the first load of each checked bit-exact.

moto is not S3: it answers one request at a time and a ranged GET costs it time in
proportion to the whole object, so the figures rank request patterns (how many requests,
how many in a row) more than they predict S3's times.

Usage: ``python benchmarks/remote_io.py [--repeat 8] [--file-per-item] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.storage import StorageReader

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from cli_args import output_file, positive_int
from io_throughput import print_table

BUCKET = "dcp-ext-bench"
TENSORS = 120


def state_dict() -> dict[str, torch.Tensor]:
    """Every fourth tensor 4 MiB, the others 256 KiB (fp32)."""
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(256, 4096 if i % 4 == 0 else 256, generator=g) for i in range(TENSORS)}


def start_server() -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """moto's S3 server in its own process, and the s3fs options that reach it, with a bucket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        options = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                   "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-west-2"}}
        fs = fsspec.filesystem("s3", **options)
        for _ in range(100):  # the server takes a few seconds to start
            try:
                fs.mkdir(BUCKET)
                return server, options
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("moto's S3 server did not start")
    except BaseException:  # an interrupt while it starts leaves no server behind
        stop_server(server)
        raise


def stop_server(server: subprocess.Popen[bytes]) -> None:
    server.kill()
    server.wait()


def measure(options: dict[str, Any], repeat: int, file_per_item: bool) -> dict[str, Any]:
    state = state_dict()
    stock_url, ours_url = f"s3://{BUCKET}/stock", f"s3://{BUCKET}/ours"
    dcp.save(state, storage_writer=FsspecWriter(stock_url, single_file_per_rank=not file_per_item, **options), no_dist=True)
    dcp.save(state, storage_writer=ShardWriter(ours_url, storage_options=options), planner=ShardSavePlanner(), no_dist=True)
    readers: dict[str, Callable[[str], StorageReader]] = {
        "stock": lambda url: FsspecReader(url, **options),
        "ours": lambda url: ShardReader(url, storage_options=options, require_commit_marker=False, cache_metadata=False),
    }
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    seconds: dict[str, list[float]] = {}
    verified: dict[str, bool] = {}
    for rep in range(repeat):
        for ckpt, url in (("stock-written", stock_url), ("ours-written", ours_url)):
            for kind, make in readers.items():
                for t in dst.values():
                    t.fill_(float("nan"))
                reader, case = make(url), f"{ckpt} {kind}"
                start = time.perf_counter()
                dcp.load(dst, storage_reader=reader, planner=ShardLoadPlanner() if kind == "ours" else None, no_dist=True)
                seconds.setdefault(case, []).append(time.perf_counter() - start)
                if rep == 0:
                    verified[case] = all(torch.equal(dst[k], v) for k, v in state.items())
    nbytes = sum(t.nbytes for t in state.values())
    return {"bytes": nbytes, "tensors": TENSORS, "file_per_item": file_per_item, "repeat": repeat,
            "cases": {case: {"seconds": s, "median_s": statistics.median(s), "verified": verified[case]}
                      for case, s in seconds.items()}}


def report(res: dict[str, Any]) -> None:
    cases = res["cases"]
    rows = []
    for ckpt in ("stock-written", "ours-written"):
        stock, ours = cases[f"{ckpt} stock"], cases[f"{ckpt} ours"]
        rows.append([ckpt, f"{stock['median_s']:.2f}", f"{ours['median_s']:.2f}",
                     f"{stock['median_s'] / ours['median_s']:.2f}x",
                     "yes" if stock["verified"] and ours["verified"] else "NO"])
    layout = "one object per tensor" if res["file_per_item"] else "one object for the process"
    print_table(f"Load from moto's S3 server, {res['bytes'] / 1e6:.0f} MB in {res['tensors']} tensors "
                f"(stock checkpoint: {layout}), seconds, median of {res['repeat']}",
                ["checkpoint", "stock FsspecReader", "ShardReader", "ours faster by", "verified"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=positive_int, default=8)
    parser.add_argument("--file-per-item", action="store_true", help="stock checkpoint with one object per tensor")
    parser.add_argument("--json", type=output_file, default=str(Path(__file__).parent / "results" / "remote_io.json"))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # a kill stops the server too
    server, options = start_server()
    try:
        res = measure(options, args.repeat, args.file_per_item)
    finally:
        stop_server(server)
    report(res)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"\nresults: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
