"""Megatron ``zarr`` checkpoints (deprecated 2024, still on disk): one zarr v2 array per tensor.

Each directory holding a ``.zarray`` is a tensor keyed by its path; its zarr chunks (one
per saving rank's shard) become the DCP chunks. Megatron writes them uncompressed
(``compressor: null``), so a chunk file is the chunk's raw bytes (C or F order, Megatron's
``"bfloat16"`` being raw bfloat16) and loads read only the byte ranges a box needs, like
any DCP record. ShardedObjects are ``{key}/shard_{offsets}_{shape}.pt`` files, exposed as
bytes items.
"""

from __future__ import annotations

import itertools
import json
import math
import posixpath
import re
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats.faults import shown
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.torch_record import TensorLayout, contiguous_strides, numel
from dcp_ext.formats.validate import is_dims
from dcp_ext.megatron.base import MegatronOptions, build_metadata, tensor_metadata
from dcp_ext.megatron.torch_dist import COMMON_PT, METADATA_JSON, check_complete
from dcp_ext.storage.catalog import Catalog
from dcp_ext.storage.location import Location

ZARRAY = ".zarray"
CHUNK_NAME = re.compile(r"[0-9]+(\.[0-9]+)*")  # a chunk file's name ("0.1"; "/"-separated chunks nest)


@dataclass(frozen=True)
class ZarrArray:
    """One array's ``.zarray`` facts."""

    path: str  # directory relative to the checkpoint
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: torch.dtype
    separator: str
    order: str  # "C" or "F": the byte order of elements inside a chunk file

    @property
    def chunk_count(self) -> int:
        return math.prod(n // c for n, c in zip(self.shape, self.chunks))

    def chunk_file(self, offsets: tuple[int, ...]) -> str:
        name = self.separator.join(str(o // c) for o, c in zip(offsets, self.chunks)) or "0"
        return f"{self.path}/{name}"


SYNC_SUFFIX = ".sync"


def find_entries(location: Location) -> tuple[dict[str, int], list[str]]:
    """(array directory -> the chunk files below it, ShardedObject ``.pt`` files), relative
    to the checkpoint."""
    names = location.walk()
    found = {posixpath.dirname(n) for n in names if posixpath.basename(n) == ZARRAY and "/" in n}
    # megatron-core writes a flattened optimizer range through zarr.ProcessSynchronizer("{key}.sync"):
    # a directory of empty lock files beside the array, named like its entries (.zarray, 0.0, ...)
    locks = {f"{array}{SYNC_SUFFIX}" for array in found}
    names = [n for n in names if n.split("/", 1)[0] not in locks]
    arrays = dict.fromkeys(sorted(found - locks), 0)
    for name in names:
        parent = posixpath.dirname(name)
        while parent and parent not in arrays:  # chunk files nest with dimension_separator "/"
            parent = posixpath.dirname(parent)
        if parent and not posixpath.basename(name).startswith("."):  # not .zarray, .zattrs
            arrays[parent] += 1
        elif not parent and "/" in name and not name.startswith(".") and CHUNK_NAME.fullmatch(posixpath.basename(name)):
            array = "/".join(itertools.takewhile(lambda part: not CHUNK_NAME.fullmatch(part), name.split("/")))
            raise CorruptCheckpointError(
                f"{location.url}/{array}: holds zarr chunk files ({name!r}) but no {ZARRAY}: the array's metadata "
                "is missing, and without it the tensor cannot be read"
            )
    objects = sorted(n for n in names if n.endswith(".pt") and "/" in n and n != COMMON_PT)
    return arrays, objects


def has_zarr_arrays(location: Location) -> bool:
    return any(location.exists(f"{name}/{ZARRAY}") for name in location.listdir() if not name.startswith("."))


def parse_zarray(location: Location, path: str) -> ZarrArray:
    where = f"{location.url}/{path}/{ZARRAY}"
    try:
        meta = json.loads(location.read_bytes(f"{path}/{ZARRAY}"))
        shape, chunks = _dims(meta, "shape", where), _dims(meta, "chunks", where)
        dtype = _torch_dtype(meta["dtype"], where)
        order = meta.get("order", "C")
        separator = meta.get("dimension_separator") or "."
        codecs = {name: meta.get(name) for name in ("compressor", "filters")}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: unreadable zarr metadata ({type(exc).__name__}: {exc})") from None
    if separator not in (".", "/"):
        raise CorruptCheckpointError(f"{where}: dimension_separator is {shown(separator)}, expected '.' or '/'")
    if any(codecs.values()) or order not in ("C", "F"):
        raise CheckpointError(
            f"{where}: array {path!r} is stored with {codecs} and order {order!r}; ShardReader reads the "
            "uncompressed, unfiltered arrays Megatron writes (compressor and filters null)"
        )
    if len(shape) != len(chunks) or any(c <= 0 or n % c for n, c in zip(shape, chunks)):
        raise CorruptCheckpointError(
            f"{where}: array {path!r} has shape {list(shape)} but chunks {list(chunks)}; Megatron writes one "
            "chunk per rank's shard, so every dimension must be a whole number of chunks"
        )
    return ZarrArray(path, shape, chunks, dtype, separator, order)


def _dims(meta: dict[str, Any], field: str, where: str) -> tuple[int, ...]:
    """``shape`` or ``chunks``: a list of sizes (not floats, which ``int()`` would truncate)."""
    value = meta[field]
    if not is_dims(value):
        raise CorruptCheckpointError(f"{where}: {field} is {shown(value)}, expected a list of sizes (integers 0 to 2**63-1)")
    return tuple(value)


def _torch_dtype(name: str, where: str) -> torch.dtype:
    if not isinstance(name, str):  # np.dtype(None) is float64
        raise CorruptCheckpointError(f"{where}: dtype is {shown(name)}, expected a numpy dtype name")
    if name == "bfloat16":  # Megatron's name for raw little-endian bfloat16
        return torch.bfloat16
    dtype = np.dtype(name)
    if dtype.byteorder == ">" and dtype.itemsize > 1:
        raise CheckpointError(f"{where}: dtype {name!r} is big-endian; ShardReader reads little-endian arrays only")
    return torch.from_numpy(np.zeros(0, dtype=dtype.newbyteorder("="))).dtype


def read_zarr_catalog(location: Location, options: MegatronOptions | None) -> Catalog:
    """The checkpoint as a catalog: each zarr chunk file is one stored chunk, read by byte
    ranges like any other (Megatron writes them uncompressed, raw C- or F-order bytes)."""
    check_complete(location, "zarr", options or MegatronOptions())
    chunk_files, object_paths = find_entries(location)
    arrays = [parse_zarray(location, path) for path in chunk_files]
    for array in arrays:
        _check_chunk_files(location, array, chunk_files[array.path])
    items: dict[MetadataIndex, StoredItem] = {}
    layouts: dict[MetadataIndex, TensorLayout] = {}
    for array in arrays:
        nbytes = numel(array.chunks) * array.dtype.itemsize
        for offsets, sizes in _grid(array):
            index = MetadataIndex(array.path, torch.Size(offsets))
            if array.order == "C":
                items[index] = StoredItem(array.chunk_file(offsets), 0, nbytes, payload_offset=0)
            else:  # column-major chunk: the same bytes seen through reversed strides
                items[index] = StoredItem(array.chunk_file(offsets), 0, nbytes)
                stride = tuple(reversed(contiguous_strides(tuple(reversed(sizes)))))
                layouts[index] = TensorLayout(0, nbytes, array.dtype, sizes, stride, 0, None)
    for path in object_paths:
        size = location.size(path)
        if size is None:
            raise CheckpointError(f"{location.url}/{path}: object file vanished while the checkpoint was opened")
        items[MetadataIndex(path.removesuffix(".pt"))] = StoredItem(path, 0, size)
    metadata = build_metadata(
        {a.path: tensor_metadata(a.dtype, a.shape, _grid(a)) for a in arrays},
        [path.removesuffix(".pt") for path in object_paths],
    )
    fingerprint = 0
    for array in arrays:
        fingerprint = crc32c.crc32c(repr(array).encode(), fingerprint)
    return Catalog(location.url, metadata, items, indexed=False, committed=True, signature=zarr_signature(location, options),
                   format="zarr", fingerprint=fingerprint, _layouts=layouts)


def zarr_signature(location: Location, options: MegatronOptions | None) -> tuple[Any, ...]:
    return (location.signature(METADATA_JSON),)


def _check_chunk_files(location: Location, array: ZarrArray, files: int) -> None:
    """Refuse a chunk grid the directory does not back, before enumerating it.

    Megatron writes every chunk (``fill_value`` None, ``write_empty_chunks=True``), so a
    missing chunk file is a lost one, reported by a load that needs it (loads of other
    chunks go on). But a ``.zarray`` of a few bytes can claim billions of chunks: an array
    missing more chunk files than it holds (beyond one) is corrupt.
    """
    missing = array.chunk_count - files
    if missing > max(files, 1):
        raise CorruptCheckpointError(
            f"{location.url}/{array.path}/{ZARRAY}: array {array.path!r} of shape {shown(list(array.shape))} in chunks of "
            f"{shown(list(array.chunks))} has {array.chunk_count:,} chunks, of which its directory holds {files:,}; "
            "Megatron writes every chunk"
        )


def _grid(array: ZarrArray) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every chunk of the array as (offsets, sizes)."""
    counts = [n // c for n, c in zip(array.shape, array.chunks)]
    return [
        (tuple(i * c for i, c in zip(cell, array.chunks)), array.chunks)
        for cell in itertools.product(*(range(n) for n in counts))
    ]
