"""Hugging Face safetensors checkpoints as a Catalog, so they load through the DCP read path.

A safetensors tensor is raw row-major bytes at known file offsets: exactly what a stored
DCP chunk with a known payload offset is. So a directory of ``*.safetensors`` files (one
file, ``save_pretrained`` shards with ``model.safetensors.index.json``, or stock
``HuggingFaceStorageWriter`` output, whose ``__metadata__`` records each shard's DCP
offsets) becomes a Catalog: one chunk per stored tensor, one StoredItem per chunk. Every
load then reads only the byte ranges it needs, straight into the destination, with the
same executors, two-stage exchange and reports as a DCP checkpoint. Only the file
headers are read here (two small reads per file).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats.faults import shown
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.safetensors_format import TensorEntry, decode_header, header_length, unique_fields
from dcp_ext.formats.data_files import check_relative_name
from dcp_ext.formats.validate import check_metadata, chunk_faults, is_dims
from dcp_ext.storage.catalog import Catalog
from dcp_ext.storage.location import Location

SUFFIX = ".safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARDING_KEY = "DCP_SHARDING_INFO"  # stock HuggingFaceStorageWriter: {fqn: {"saved_offsets": [...]}}
_FIRST_READ = 64 << 10  # header bytes read at once; a longer header costs a second read


def safetensors_files(location: Location) -> list[str]:
    """The ``*.safetensors`` files of a directory without ``.metadata`` (empty: not safetensors)."""
    try:
        names = location.listdir()
    except (FileNotFoundError, NotADirectoryError):
        return []
    if ".metadata" in names:
        return []
    return sorted(n for n in names if n.endswith(SUFFIX))


def safetensors_signature(location: Location) -> tuple[Any, ...]:
    """Changes when any file of the checkpoint (or the index) is rewritten."""
    names = [*safetensors_files(location), INDEX_NAME]
    return tuple((name, location.signature(name)) for name in names)


def read_safetensors_catalog(location: Location) -> Catalog:
    """Parse every file's header (and the index, when there is one) into a Catalog."""
    signature = safetensors_signature(location)
    weight_map = _weight_map(location)
    files = safetensors_files(location) if weight_map is None else sorted(set(weight_map.values()))
    if not files:
        raise CheckpointError(f"{location.url}: no {SUFFIX} files here")
    chunks: dict[str, list[tuple[TensorEntry, tuple[int, ...], str]]] = defaultdict(list)
    fingerprint = 0
    for name in files:
        entries, metadata, header = _read_header(location, name)
        fingerprint = crc32c.crc32c(name.encode() + header, fingerprint)
        offsets = _sharding_offsets(metadata, entries, f"{location.url}/{name}")
        for key, entry in entries.items():
            if weight_map is None or weight_map.get(key, name) == name:  # the index says where a key lies
                chunks[key].append((entry, offsets.get(key, (0,) * len(entry.shape)), name))
    if weight_map is not None:
        _check_index(location, weight_map, chunks)
    state_dict_metadata: dict[str, Any] = {}
    items: dict[MetadataIndex, StoredItem] = {}
    for key, pieces in chunks.items():
        dtypes = {entry.dtype for entry, _, _ in pieces}
        if len(dtypes) > 1:
            raise CorruptCheckpointError(f"{location.url}: key {key!r} is stored with different dtypes {sorted(map(str, dtypes))}")
        md = state_dict_metadata[key] = TensorStorageMetadata(
            TensorProperties(dtype=pieces[0][0].dtype),
            torch.Size(_global_size(pieces)),
            [ChunkStorageMetadata(torch.Size(offsets), torch.Size(entry.shape)) for entry, offsets, _ in pieces],
        )
        faults = chunk_faults(key, md)
        if faults:  # the shape is inferred from the pieces: a gap is a missing file, an overlap a stray one
            holders = sorted({name for _, _, name in pieces})
            raise CorruptCheckpointError(
                f"{location.url}: {faults[0]} (key {key!r} in {', '.join(holders)}); expected its pieces to cover "
                f"it exactly once: a file missing, or one left from another save?"
            )
        for entry, offsets, name in pieces:
            items[MetadataIndex(key, torch.Size(offsets))] = StoredItem(name, entry.begin, entry.nbytes, entry.begin)
    metadata = Metadata(state_dict_metadata, storage_meta=StorageMeta())
    check_metadata(metadata, items, location.url, {})
    return Catalog(
        location.url, metadata, items, indexed=True, committed=True, signature=signature, format="safetensors",
        fingerprint=fingerprint,
    )


def _global_size(pieces: list[tuple[TensorEntry, tuple[int, ...], str]]) -> list[int]:
    """The smallest shape holding every chunk (stock HuggingFaceStorageReader's rule)."""
    ndim = len(pieces[0][0].shape)
    return [max(offsets[d] + entry.shape[d] for entry, offsets, _ in pieces) for d in range(ndim)]


def _read_header(location: Location, name: str) -> tuple[dict[str, TensorEntry], dict[str, str], bytes]:
    """A file's tensors, its ``__metadata__`` and the header bytes themselves."""
    where = f"{location.url}/{name}"
    size = location.size(name)
    if size is None:
        raise CorruptCheckpointError(f"{where}: file is missing")
    with location.open_reader(name) as reader:
        prefix = bytearray(min(size, _FIRST_READ))
        reader.read_into(0, [memoryview(prefix)])
        needed = 8 + header_length(bytes(prefix), size, where)
        if needed > len(prefix):
            rest = bytearray(needed - len(prefix))
            reader.read_into(len(prefix), [memoryview(rest)])
            prefix += rest
    header = bytes(prefix[:needed])
    return (*decode_header(header, size, where), header)


def _sharding_offsets(metadata: dict[str, str], entries: dict[str, TensorEntry], where: str) -> dict[str, tuple[int, ...]]:
    """Per-key chunk offsets recorded by stock ``HuggingFaceStorageWriter`` (none: whole tensors)."""
    raw = metadata.get(SHARDING_KEY)
    if raw is None:
        return {}
    try:
        info = json.loads(raw, object_pairs_hook=unique_fields)
        offsets = {key: value["saved_offsets"] for key, value in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: unreadable {SHARDING_KEY} in __metadata__ ({type(exc).__name__}: {exc})") from None
    for key, entry in entries.items():
        found = offsets.get(key)
        if not is_dims(found) or len(found) != len(entry.shape):
            raise CorruptCheckpointError(f"{where} key {key!r}: {SHARDING_KEY} gives offsets {shown(found)}, shape is {list(entry.shape)}")
    return {key: tuple(offsets[key]) for key in entries}


def _weight_map(location: Location) -> dict[str, str] | None:
    """``model.safetensors.index.json``'s key -> file map, or None without an index. With an
    index only the files it names are read, as transformers does: shards of an earlier save
    left in the directory are not part of the checkpoint."""
    try:
        raw = location.read_bytes(INDEX_NAME)
    except FileNotFoundError:
        return None
    where = f"{location.url}/{INDEX_NAME}"
    try:
        weight_map = json.loads(raw)["weight_map"]
        assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
    except (ValueError, KeyError, TypeError, AssertionError, RecursionError):
        raise CorruptCheckpointError(f"{where}: expected a JSON object with a weight_map of file names") from None
    for key, name in weight_map.items():
        check_relative_name(where, name.removeprefix("./"), key)
    return {key: name.removeprefix("./") for key, name in weight_map.items()}


def _check_index(location: Location, weight_map: dict[str, str], chunks: dict[str, list[tuple[TensorEntry, tuple[int, ...], str]]]) -> None:
    """Every key of the index lies in the file it is mapped to."""
    for key, name in weight_map.items():
        if key not in chunks:
            raise CorruptCheckpointError(
                f"{location.url}/{INDEX_NAME}: key {key!r} is mapped to {name!r}, which does not hold it"
            )
