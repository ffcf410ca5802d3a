"""``dcp-ext inspect PATH``: what a checkpoint holds, without loading tensors."""

from __future__ import annotations

import argparse
import json
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_ext.formats.index import dtype_name
from dcp_ext.megatron.base import MegatronOptions
from dcp_ext.megatron.describe import describe_source
from dcp_ext.megatron.detect import open_source
from dcp_ext.megatron.torch_dist import torch_dist_view
from dcp_ext.storage.catalog import read_catalog
from dcp_ext.storage.location import Location


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory or URL")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def describe(path: str) -> dict[str, Any]:
    location, megatron = Location(path), MegatronOptions(allow_incomplete=True)
    source = open_source(location, megatron, cached=False)
    if source is not None:  # Megatron zarr / legacy
        return describe_source(source)
    catalog = torch_dist_view(location, read_catalog(location), megatron)
    keys = []
    for fqn, md in catalog.metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            items = [catalog.items[MetadataIndex(fqn, c.offsets)] for c in md.chunks]
            keys.append({
                "key": fqn,
                "kind": "tensor",
                "dtype": dtype_name(md.properties.dtype),
                "shape": list(md.size),
                "chunks": len(md.chunks),
                "bytes": sum(i.length for i in items),
                "files": sorted({i.relative_path for i in items}),
            })
        else:
            item = catalog.items[MetadataIndex(fqn)]
            keys.append({"key": fqn, "kind": "bytes", "dtype": None, "shape": None, "chunks": 1,
                         "bytes": item.length, "files": [item.relative_path]})
    return {
        "path": catalog.url,
        "index": catalog.indexed,
        "keys": keys,
        "files": len({i.relative_path for i in catalog.items.values()}),
        "bytes": sum(i.length for i in catalog.items.values()),
    }


def main(args: argparse.Namespace) -> int:
    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [("key", "dtype", "shape", "chunks", "bytes", "files")]
    for k in info["keys"]:
        shape = "x".join(map(str, k["shape"])) if k["shape"] is not None else "-"
        rows.append((k["key"], k["dtype"] or "bytes", shape or "scalar", str(k["chunks"]), str(k["bytes"]),
                     ",".join(k["files"]) if len(k["files"]) <= 2 else f"{len(k['files'])} files"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    source = info.get("format") or ("dcp_ext index" if info["index"] else ".metadata pickle (restricted)")
    print(f"\n{len(info['keys'])} keys, {info['files']} files, {info['bytes']} bytes; metadata from {source}")
    return 0
