"""Loads into CUDA memory: stock DCP ``FileSystemReader`` versus ``ShardReader``, with the
ceilings measured in the same run.

One process, one GPU. A deterministic state dict of mixed tensor sizes (default ~4 GB:
half in 128 MiB tensors, 30% in 8 MiB, 20% in 256 KiB; fp32 and bf16) is saved once with
``ShardWriter``; both readers then load that checkpoint into preallocated, garbage-filled
CUDA tensors, cold (page cache dropped) and warm. The ceilings:

* disk read: sequential 16 MiB reads of one file of the same size into host memory,
  cold and warm;
* pinned H2D: ``Tensor.copy_(non_blocking=True)`` of a 256 MiB pinned buffer to the GPU,
  the same number of bytes.

Target (issue 16, item 4): ``ShardReader`` >= 0.8x of min(disk read, pinned H2D), cold and
warm. ``ShardReader`` loads with ``ShardLoadPlanner``, as README.md tells users to, and warm
under DCP's default planner too (a ``dcp.load`` without ``planner=``); stock with its default.
The loaded values are checked bit-exact against the saved ones once.

Saves of the same tensors on the GPU are timed too: stock ``FileSystemWriter`` and
``ShardWriter`` (checksums and atomic commit on), both with our writer's default thread count
and fsync, each into a fresh directory with no dirty pages left from before, against
min(one thread's sequential write + fsync, pinned D2H).

Usage::

    python benchmarks/gpu_io.py                       # ~4 GB, 3 repeats, JSON to benchmarks/results/gpu_io.json
    python benchmarks/gpu_io.py --size-gib 1 --repeat 5 --dir /mnt/nvme/tmp

Without a CUDA device it prints one line to stderr and exits with status 77 (the automake
convention for a skipped test), measuring and writing nothing. Cold runs drop the page
cache (``/proc/sys/vm/drop_caches``, root only); when that is not permitted, cold figures
are reported as null.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cli_args import existing_dir, output_file, positive_float, positive_int

SKIPPED = 77
GB = 1e9
READ_BYTES = 16 << 20
PINNED_BYTES = 256 << 20
MIX = ((128 << 20, 0.5), (8 << 20, 0.3), (256 << 10, 0.2))  # (tensor bytes, share of the total)
TARGET = 0.8


def build_state(total_bytes: int) -> dict[str, torch.Tensor]:
    """Deterministic tensors (on the CPU) of the mix; every third one bf16."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for size, share in MIX:
        for n in range(max(1, int(total_bytes * share) // size)):
            dtype = torch.bfloat16 if len(state) % 3 == 2 else torch.float32
            rows = size // (1024 * dtype.itemsize)
            state[f"t{size >> 10}k_{n}"] = torch.randn(rows, 1024, generator=g).to(dtype)
    return state


def drop_caches() -> bool:
    """Drop the page cache; False when not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of ``fn`` up to the moment the GPU has finished its work."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def disk_read(path: Path) -> None:
    buf = bytearray(READ_BYTES)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def write_raw(path: Path, state: dict[str, torch.Tensor]) -> None:
    """The tensors' bytes back to back in one file, then fsync: the write ceiling, and the
    file the read ceiling reads."""
    with open(path, "wb") as f:
        for tensor in state.values():
            f.write(memoryview(tensor.view(torch.uint8).numpy()))
        os.fsync(f.fileno())


def pinned_copies(total_bytes: int, to_device: bool) -> Callable[[], None]:
    """``total_bytes`` of copies between a 256 MiB pinned host buffer and the GPU."""
    host = torch.empty(PINNED_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(PINNED_BYTES, dtype=torch.uint8, device="cuda")
    src, dst = (host, device) if to_device else (device, host)

    def copy() -> None:
        for _ in range(max(1, total_bytes // PINNED_BYTES)):
            dst.copy_(src, non_blocking=True)

    return copy


def garbage_dests(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full(v.shape, float("nan"), dtype=v.dtype, device="cuda") for k, v in state.items()}


def median(runs: list[float | None]) -> float | None:
    """Median seconds (None when a figure could not be taken)."""
    taken = [r for r in runs if r is not None]
    return statistics.median(taken) if taken and len(taken) == len(runs) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=positive_float, default=4.0)
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--dir", type=existing_dir, default=None, help="where the checkpoint and the raw file go (default: a temp dir)")
    parser.add_argument("--out", type=output_file, default=str(Path(__file__).parent / "results" / "gpu_io.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu_io.py: no CUDA device: nothing measured (exit {SKIPPED}: skipped)", file=sys.stderr)
        return SKIPPED

    import torch.distributed.checkpoint as dcp

    from dcp_ext import ShardLoadPlanner, ShardReader, ShardWriter, clear_caches
    from dcp_ext.runtime.threads import io_thread_count

    work = Path(tempfile.mkdtemp(prefix="gpu_io_", dir=args.dir))
    try:
        state = build_state(int(args.size_gib * (1 << 30)))
        total = sum(t.nbytes for t in state.values())
        ckpt, raw = work / "ckpt", work / "raw.bin"
        dcp.save(state, storage_writer=ShardWriter(ckpt))
        on_gpu = {k: v.cuda() for k, v in state.items()}
        h2d, d2h = pinned_copies(total, to_device=True), pinned_copies(total, to_device=False)
        # (reader, planner, page-cache states): each reader with its documented planner, and
        # ours under DCP's default planner too, which is what a dcp.load without planner= gets
        readers: dict[str, tuple[Callable[[], Any], Callable[[], Any], tuple[str, ...]]] = {
            "stock": (lambda: dcp.FileSystemReader(ckpt), lambda: None, ("cold", "warm")),
            "dcp_ext": (lambda: ShardReader(ckpt), ShardLoadPlanner, ("cold", "warm")),
            "dcp_ext_default_planner": (lambda: ShardReader(ckpt), lambda: None, ("warm",)),
        }
        threads = io_thread_count()  # both writers at ours, with fsync and (ours) checksums
        writers = {
            "stock": lambda path: dcp.FileSystemWriter(path, thread_count=threads, sync_files=True),
            "dcp_ext": lambda path: ShardWriter(path, thread_count=threads, sync_files=True, checksums=True),
        }
        times: dict[str, list[float | None]] = {
            name: []
            for name in (
                "write_fsync", "d2h", *(f"{w}_save" for w in writers),
                "disk_cold", "disk_warm", "h2d", *(f"{r}_{c}" for r, (*_, caches) in readers.items() for c in caches),
            )
        }
        for _ in range(args.repeat):
            os.sync()
            times["write_fsync"].append(seconds(lambda: write_raw(raw, state)))
            times["d2h"].append(seconds(d2h))
            for name, make_writer in writers.items():
                target = work / f"save_{name}"
                os.sync()
                times[f"{name}_save"].append(seconds(lambda m=make_writer, t=target: dcp.save(on_gpu, storage_writer=m(t))))
                shutil.rmtree(target)
            times["disk_cold"].append(seconds(lambda: disk_read(raw)) if drop_caches() else None)
            times["disk_warm"].append(seconds(lambda: disk_read(raw)))
            times["h2d"].append(seconds(h2d))
            for name, (make, planner, caches) in readers.items():
                for cache in caches:
                    dest = garbage_dests(state)
                    clear_caches()
                    if cache == "cold" and not drop_caches():
                        times[f"{name}_{cache}"].append(None)
                        continue
                    load = lambda d=dest, m=make, p=planner: dcp.load(d, storage_reader=m(), planner=p())  # noqa: E731
                    times[f"{name}_{cache}"].append(seconds(load))
                    del dest
        dest = garbage_dests(state)
        dcp.load(dest, storage_reader=ShardReader(ckpt), planner=ShardLoadPlanner())
        exact = all(torch.equal(dest[k].cpu().view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())
        del dest
        rate = {name: None if median(runs) is None else total / median(runs) / GB for name, runs in times.items()}
        result = {
            "device": torch.cuda.get_device_name(),
            "host": platform.node(),
            "torch": torch.__version__,
            "bytes": total,
            "tensors": len(state),
            "repeat": args.repeat,
            "save_threads": threads,
            "gb_per_s": rate,
            "seconds": times,
            "bit_exact": exact,
            "target": TARGET,
        }
        save_ceiling = min(rate["write_fsync"], rate["d2h"])
        result["ceiling_save"] = save_ceiling
        result["dcp_ext_vs_ceiling_save"] = rate["dcp_ext_save"] / save_ceiling
        result["dcp_ext_vs_stock_save"] = rate["dcp_ext_save"] / rate["stock_save"]
        for cache in ("cold", "warm"):
            disk, ours, stock = rate[f"disk_{cache}"], rate[f"dcp_ext_{cache}"], rate[f"stock_{cache}"]
            ceiling = None if disk is None else min(disk, rate["h2d"])
            result[f"ceiling_{cache}"] = ceiling
            result[f"dcp_ext_vs_ceiling_{cache}"] = None if ceiling is None else ours / ceiling
            result[f"dcp_ext_vs_stock_{cache}"] = None if stock is None else ours / stock
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return 0 if exact else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
