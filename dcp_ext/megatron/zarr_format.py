"""Megatron ``zarr`` checkpoints (deprecated 2024, still on disk): one zarr v2 array per tensor.

Each directory holding a ``.zarray`` is a tensor keyed by its path; its zarr chunks (one
per saving rank's shard) become the DCP chunks. Reads go through TensorStore, which
fetches only the chunks a box touches and understands Megatron's ``"bfloat16"`` dtype.
ShardedObjects are ``{key}/shard_{offsets}_{shape}.pt`` files, exposed as bytes items.
"""

from __future__ import annotations

import itertools
import json
import os
import posixpath
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats.torch_record import numel
from dcp_ext.megatron.base import ChunkRead, MegatronOptions, MegatronSource, build_metadata, tensor_metadata
from dcp_ext.megatron.torch_dist import COMMON_PT, METADATA_JSON, check_complete
from dcp_ext.storage.location import Location

ZARRAY = ".zarray"


@dataclass(frozen=True)
class ZarrArray:
    """One array's ``.zarray`` facts."""

    path: str  # directory relative to the checkpoint
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: torch.dtype
    separator: str

    def chunk_file(self, offsets: tuple[int, ...]) -> str:
        name = self.separator.join(str(o // c) for o, c in zip(offsets, self.chunks)) or "0"
        return f"{self.path}/{name}"


def find_entries(location: Location) -> tuple[list[str], list[str]]:
    """(array directories, ShardedObject ``.pt`` files), relative to the checkpoint."""
    if location.is_local:
        names = [
            os.path.relpath(os.path.join(parent, f), location.root).replace(os.sep, "/")
            for parent, _, files in os.walk(location.root)
            for f in files
        ]
    else:
        assert location.fs is not None
        names = [posixpath.relpath(p, location.root) for p in location.fs.find(location.root)]
    arrays = sorted(posixpath.dirname(n) for n in names if posixpath.basename(n) == ZARRAY and "/" in n)
    objects = sorted(n for n in names if n.endswith(".pt") and "/" in n and n != COMMON_PT)
    return arrays, objects


def has_zarr_arrays(location: Location) -> bool:
    return any(location.exists(f"{name}/{ZARRAY}") for name in location.listdir() if not name.startswith("."))


def parse_zarray(location: Location, path: str) -> ZarrArray:
    where = f"{location.url}/{path}/{ZARRAY}"
    try:
        meta = json.loads(location.read_bytes(f"{path}/{ZARRAY}"))
        shape, chunks = tuple(int(n) for n in meta["shape"]), tuple(int(n) for n in meta["chunks"])
        dtype = _torch_dtype(meta["dtype"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{where}: unreadable zarr metadata ({type(exc).__name__}: {exc})") from None
    if len(shape) != len(chunks) or any(c <= 0 or n % c for n, c in zip(shape, chunks)):
        raise CorruptCheckpointError(
            f"{where}: array {path!r} has shape {list(shape)} but chunks {list(chunks)}; Megatron writes one "
            "chunk per rank's shard, so every dimension must be a whole number of chunks"
        )
    return ZarrArray(path, shape, chunks, dtype, meta.get("dimension_separator") or ".")


def _torch_dtype(name: str) -> torch.dtype:
    if name == "bfloat16":
        return torch.bfloat16
    return torch.from_numpy(np.zeros(0, dtype=np.dtype(name).newbyteorder("="))).dtype


class ZarrSource(MegatronSource):
    format = "zarr"

    def __init__(self, location: Location, options: MegatronOptions):
        check_complete(location, "zarr", options)
        self.location = location
        self.url = location.url
        array_paths, object_paths = find_entries(location)
        self.arrays = {path: parse_zarray(location, path) for path in array_paths}
        self.objects = {path.removesuffix(".pt"): path for path in object_paths}
        self.metadata = build_metadata(
            {key: tensor_metadata(a.dtype, a.shape, _grid(a)) for key, a in self.arrays.items()},
            list(self.objects),
        )
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def signature(self) -> tuple[Any, ...]:
        return (self.location.signature(METADATA_JSON),)

    def chunk_files(self, index: MetadataIndex) -> list[str]:
        if index.offset is None:
            return [self.objects[index.fqn]]
        return [self.arrays[index.fqn].chunk_file(tuple(index.offset))]

    def read_bytes(self, fqn: str) -> bytes:
        return self.location.read_bytes(self.objects[fqn])

    def read_tensor(
        self, index: MetadataIndex, offsets: tuple[int, ...], lengths: tuple[int, ...], dest: torch.Tensor
    ) -> ChunkRead:
        array = self.arrays[index.fqn]
        start = tuple(c + o for c, o in zip(index.offset, offsets))
        region = tuple(slice(s, s + n) for s, n in zip(start, lengths))
        try:
            data = self._store(array)[region].read().result()
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"{self.url}: zarr array {index.fqn!r} region {[[s.start, s.stop] for s in region]}: {exc}"
            ) from None
        if array.dtype == torch.bfloat16:
            dest.copy_(torch.from_numpy(np.ascontiguousarray(data).view(np.uint16)).view(torch.bfloat16))
        else:
            dest.copy_(torch.from_numpy(np.ascontiguousarray(data)))
        chunk_bytes = numel(array.chunks) * array.dtype.itemsize
        return ChunkRead(chunk_bytes, frozenset({array.chunk_file(tuple(index.offset))}))

    def _store(self, array: ZarrArray) -> Any:
        with self._lock:
            store = self._stores.get(array.path)
            if store is None:
                store = ts.open(self._spec(array), read=True).result()
                self._stores[array.path] = store
            return store

    def _spec(self, array: ZarrArray) -> dict[str, Any]:
        if self.location.is_local:
            kvstore: Any = {"driver": "file", "path": self.location.path(array.path) + "/"}
        else:
            kvstore = f"{self.url}/{array.path}/"
        return {"driver": "zarr", "kvstore": kvstore, "fill_missing_data_reads": False}


def _grid(array: ZarrArray) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every chunk of the array as (offsets, sizes)."""
    counts = [n // c for n, c in zip(array.shape, array.chunks)]
    return [
        (tuple(i * c for i, c in zip(cell, array.chunks)), array.chunks)
        for cell in itertools.product(*(range(n) for n in counts))
    ]
