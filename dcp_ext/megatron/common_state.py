"""``load_common_state(path)``: Megatron's non-sharded state (args, iteration, ...) without plain pickle."""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_ext.errors import CheckpointError
from dcp_ext.formats.data_files import is_data_file
from dcp_ext.formats.faults import file_too_short
from dcp_ext.formats.index import INDEX_NAME
from dcp_ext.megatron.base import MegatronOptions
from dcp_ext.megatron.detect import detect_format
from dcp_ext.megatron.legacy import LegacyCheckpoint
from dcp_ext.formats.safe_load import safe_torch_load
from dcp_ext.megatron.torch_dist import COMMON_PT, SAVE_OPTIONS, check_complete, common_state_key, is_megatron_catalog
from dcp_ext.storage.catalog import read_catalog
from dcp_ext.storage.catalog_formats import FORMATS, check_options_apply
from dcp_ext.storage.location import Location


def load_common_state(
    path: str | os.PathLike[str],
    *,
    options: MegatronOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The common state dict of a torch_dist, zarr or legacy Megatron checkpoint.

    torch_dist/zarr: ``common.pt``, or (newer megatron-core) the ``common_state``
    ShardedObject inside the DCP data; legacy: the non-model entries of the TP0/PP0 file
    (``args``, ``iteration``, ``checkpoint_version``, ...). Loaded with
    ``weights_only=True`` and a small allowlist (argparse.Namespace, numpy arrays); a class
    it refuses (Megatron-LM keeps megatron-core enums in ``args``) loads once registered
    with ``torch.serialization.add_safe_globals``, as the refusal says.
    """
    location = Location(path, storage_options)
    options = options or MegatronOptions()
    kind = detect_format(location)
    if kind == "legacy":
        check_options_apply(location, options, FORMATS["legacy"].option_names, "legacy")
        checkpoint = LegacyCheckpoint(location, options)  # its tensors are layouts: load the values
        path = checkpoint.files[(0, 0, 0)]
        where = f"{location.url}/{path}"
        local = location.local_file(path)  # memory-mapped: the weights in that file stay unread
        state = (safe_torch_load(local, where, mmap=True, megatron=True) if local
                 else safe_torch_load(location.read_bytes(path), where, megatron=True))
        return {key: value for key, value in state.items() if key in checkpoint.common}
    if location.exists(COMMON_PT):  # Megatron's mark, unless beside our index (a convert's copy: is_megatron_catalog)
        _check_as_a_load(location, options, kind, megatron=kind != "dcp" or not location.exists(INDEX_NAME))
        return safe_torch_load(location.read_bytes(COMMON_PT), f"{location.url}/{COMMON_PT}", megatron=True)
    if kind == "dcp":
        catalog = read_catalog(location)
        key = common_state_key(catalog.metadata)
        if key is not None:
            _check_as_a_load(location, options, kind, megatron=is_megatron_catalog(location, catalog))
            item = catalog.item(MetadataIndex(key))
            where = f"{location.url}/{item.relative_path} key {key!r}"
            _check_holds(location, item.relative_path, item.offset + item.length, where)
            with location.open_reader(item.relative_path, key) as reader:
                buf = bytearray(item.length)
                reader.read_into(item.offset, [memoryview(buf)])
            state = safe_torch_load(bytes(buf), where, megatron=True)
            return state[0] if isinstance(state, list) and len(state) == 1 else state
    raise CheckpointError(f"{location.url}: no Megatron common state ({COMMON_PT} or a common_state object)")


def _check_as_a_load(location: Location, options: MegatronOptions, kind: str | None, megatron: bool) -> None:
    """The options given, and a Megatron save's completeness (its ``metadata.json``), checked
    as a load of the checkpoint checks them, without parsing its catalog: a caller after
    ``args`` alone should not pay for every key's metadata."""
    if kind is None and not any(is_data_file(name) for name in location.listdir()):
        check_options_apply(location, options, frozenset(), "directory's")  # a common.pt alone
        return
    if not megatron:  # a DCP checkpoint (ours, converted) holding the common-state object
        check_options_apply(location, options, frozenset(), "dcp")
        return
    # a torch_dist save (also one interrupted before its .metadata: megatron-core writes
    # common.pt first, the data files next, metadata.json last) or a zarr one
    backend = "zarr" if kind == "zarr" else "torch_dist"
    check_options_apply(location, options, SAVE_OPTIONS, "zarr" if kind == "zarr" else "Megatron torch_dist")
    check_complete(location, backend, options)


def _check_holds(location: Location, path: str, end: int, where: str) -> None:
    """The file holds bytes up to ``end``, checked before a buffer that long is allocated:
    the metadata may claim gigabytes of a small file. (A missing file: opening it says so.)"""
    size = location.size(path)
    if size is not None and end > size:
        raise file_too_short(where, end, size)
