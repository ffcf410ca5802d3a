"""``dcp-ext inspect PATH``: what a checkpoint holds, without loading tensors."""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_ext.cli.terminal import for_cell
from dcp_ext.formats.data_files import saving_rank
from dcp_ext.formats.index import dtype_name
from dcp_ext.megatron.base import MegatronOptions
from dcp_ext.storage.catalog import Catalog
from dcp_ext.storage.catalog_formats import open_catalog
from dcp_ext.storage.location import Location


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory or URL")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--stats", action="store_true", help="add where the bytes are: per rank file, per rank, copies, largest tensors"
    )

LARGEST = 10


FORMAT_NAMES = {"zarr": "Megatron zarr checkpoint", "legacy": "Megatron legacy checkpoint",
                "safetensors": "safetensors checkpoint"}


def describe(path: str, stats: bool = False) -> dict[str, Any]:
    location = Location(path)
    catalog, _ = open_catalog(location, cached=False, options=MegatronOptions(allow_incomplete=True), check_options=False)
    keys = []
    for fqn, md in catalog.metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            indices = [MetadataIndex(fqn, c.offsets) for c in md.chunks]
            keys.append({
                "key": fqn,
                "kind": "tensor",
                "dtype": dtype_name(md.properties.dtype),
                "shape": list(md.size),
                "chunks": len(md.chunks),
                "bytes": sum(_stored_bytes(catalog, index) for index in indices),
                "files": sorted({catalog.items[index].relative_path for index in indices}),
            })
        else:
            index = MetadataIndex(fqn)
            keys.append({"key": fqn, "kind": "bytes", "dtype": None, "shape": None, "chunks": 1,
                         "bytes": _stored_bytes(catalog, index), "files": [catalog.items[index].relative_path]})
    info = {
        "path": catalog.url,
        "index": catalog.indexed,
        "keys": keys,
        "files": len({i.relative_path for i in itertools.chain(catalog.items.values(), *catalog.copies.values())}),
        "bytes": sum(k["bytes"] for k in keys),
    }
    if catalog.format in FORMAT_NAMES:
        info["format"] = FORMAT_NAMES[catalog.format]
    if stats:
        info["stats"] = storage_stats(catalog, keys)
    return info


def _stored_bytes(catalog: Catalog, index: MetadataIndex) -> int:
    """Bytes an item occupies: its record, or its share of a storage other tensors share
    (legacy Megatron), or its serialized bytes when the format synthesizes them."""
    if index in catalog.inline:
        return len(catalog.inline[index])
    if catalog.format == "legacy":
        return catalog.chunk_nbytes(index) or 0
    return catalog.items[index].length


def storage_stats(catalog: Catalog, keys: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the bytes are: per data file, per saving rank, TP-replica copies, largest tensors."""
    files: dict[str, dict[str, int]] = {}
    for item in itertools.chain(catalog.items.values(), *catalog.copies.values()):
        entry = files.setdefault(item.relative_path, {"items": 0, "bytes": 0})
        entry["items"] += 1
        entry["bytes"] += item.length
    per_rank: dict[int, int] = {}  # -1: files no rank prefix names
    for name, entry in files.items():
        rank = saving_rank(name)
        rank = -1 if rank is None else rank
        per_rank[rank] = per_rank.get(rank, 0) + entry["bytes"]
    copies = [c for group in catalog.copies.values() for c in group]
    largest = sorted((k for k in keys if k["kind"] == "tensor"), key=lambda k: -k["bytes"])[:LARGEST]
    return {
        "files": dict(sorted(files.items())),
        "bytes_per_rank": dict(sorted(per_rank.items())),
        "replica_copies": len(copies),
        "replica_bytes": sum(c.length for c in copies),
        "largest": [{"key": k["key"], "bytes": k["bytes"], "shape": k["shape"], "dtype": k["dtype"]} for k in largest],
    }


def main(args: argparse.Namespace) -> int:
    info = describe(args.path, stats=args.stats)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [("key", "dtype", "shape", "chunks", "bytes", "files")]
    for k in info["keys"]:
        shape = "x".join(map(str, k["shape"])) if k["shape"] is not None else "-"
        rows.append((for_cell(k["key"]), k["dtype"] or "bytes", shape or "scalar", str(k["chunks"]), str(k["bytes"]),
                     for_cell(",".join(k["files"])) if len(k["files"]) <= 2 else f"{len(k['files'])} files"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    source = info.get("format") or ("dcp_ext index" if info["index"] else ".metadata pickle (restricted)")
    print(f"\n{len(info['keys'])} keys, {info['files']} files, {info['bytes']} bytes; metadata from {source}")
    if "stats" in info:
        _print_stats(info["stats"])
    return 0


def _print_stats(stats: dict[str, Any]) -> None:
    print("\nper data file: items, bytes")
    for name, entry in stats["files"].items():
        print(f"  {for_cell(name)}  {entry['items']}  {entry['bytes']}")
    per_rank = stats["bytes_per_rank"]
    print("\nbytes per saving rank: " + ", ".join(f"{rank}: {n}" for rank, n in per_rank.items()))
    if per_rank:
        values = list(per_rank.values())
        print(f"balance: max/mean {max(values) / (sum(values) / len(values)):.2f}")
    print(f"TP-replica copies: {stats['replica_copies']} ({stats['replica_bytes']} bytes)")
    print("largest tensors:")
    for k in stats["largest"]:
        print(f"  {for_cell(k['key'])}  {k['dtype']}  {'x'.join(map(str, k['shape']))}  {k['bytes']} bytes")
