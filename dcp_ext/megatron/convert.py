"""Copy any checkpoint ShardReader can read (DCP, torch_dist, zarr, legacy) into a ShardWriter one.

Streaming: the save plan is made from shapes alone (meta tensors); each item is read from
the source only when the writer asks for it and dropped once written, so with one writer
thread peak memory is about the largest tensor, not the model. Bytes items are copied as
stored, never unpickled.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItem

from dcp_ext.errors import CheckpointExistsError, InvalidRequestError
from dcp_ext.formats.safe_load import safe_load_bytes
from dcp_ext.formats.torch_record import numel
from dcp_ext.megatron.base import MegatronOptions
from dcp_ext.megatron.torch_dist import COMMON_PT
from dcp_ext.runtime.options import callback, flag
from dcp_ext.storage.catalog_formats import held_format
from dcp_ext.storage.location import Location
from dcp_ext.storage.reader import check_records_held, checking_reader
from dcp_ext.storage.writer import ShardWriter


def _check_destination(source: Location, target: Location, overwrite: bool) -> None:
    if target.cache_key() == source.cache_key():
        raise InvalidRequestError(f"{target.url}: is the source checkpoint; convert into another directory")
    if target.is_local and os.path.isfile(target.root):
        raise InvalidRequestError(f"{target.url}: is a file; the destination must be a directory")
    held = held_format(target)
    if held is not None and not overwrite:  # refused here, not by the writer, to name the flag too
        then = "to replace it" if held == "dcp" else "to write ours beside it (readers of our format then see ours)"
        raise CheckpointExistsError(
            f"{target.url}: holds a {held} checkpoint; convert into another directory, or pass overwrite=True "
            f"(dcp-ext convert --overwrite) {then}"
        )


UNSAFE_OPT_OUT = "convert(allow_unsafe_bytes=True) (dcp-ext convert --allow-unsafe-bytes)"


@dataclass
class ConvertReport:
    keys: int
    bytes: int
    not_copied: list[str] = field(default_factory=list)  # source files outside the DCP data (Megatron's common.pt)


class _RawBytesLoadPlanner(DefaultLoadPlanner):
    """Keeps bytes items as the stored bytes (by key) instead of unpickling them."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


class _StreamingSavePlanner(DefaultSavePlanner):
    """Resolves each write item by reading it from the source at write time, and keeps the
    source's ``planner_data`` (DCP's flatten mappings: the nesting that stock tools such as
    ``dcp_to_torch_save`` rebuild; the flat state saved here would record none)."""

    def __init__(self, fetch: Callable[[str], torch.Tensor | io.BytesIO], planner_data: Any):
        super().__init__()
        self.fetch = fetch
        self.source_planner_data = planner_data

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        keys = set(metadata.state_dict_metadata)
        if isinstance(self.source_planner_data, dict) and set(self.source_planner_data) == keys:
            metadata.planner_data = self.source_planner_data
        return plans, metadata

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self.fetch(write_item.index.fqn)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    options: MegatronOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    require_commit_marker: bool | None = None,
    allow_unsafe_bytes: bool = False,
) -> ConvertReport:
    """Write every item of ``src`` to a new ShardWriter checkpoint at ``dst``.

    ``dst`` must not be ``src`` nor a file; a checkpoint already at ``dst`` (of any format
    the reader opens) is replaced, or written beside, only with ``overwrite=True`` (else
    ``CheckpointExistsError``). ``require_commit_marker``
    is ``ShardReader``'s: False copies a checkpoint whose save was interrupted after its
    data files were written. Bytes items are copied as stored, and first pass the reader's
    restricted loader unless ``allow_unsafe_bytes=True``: a copy of a pickle that runs code
    would hand it to stock loaders (DCP's default planner unpickles bytes items).
    """
    flag("convert", "allow_unsafe_bytes", allow_unsafe_bytes)
    callback("convert", "progress", progress)
    # bytes items are checked below with convert's own opt-out named, then copied as stored
    reader = checking_reader(
        src, megatron=options, storage_options=storage_options, allow_unsafe_bytes=True,
        require_commit_marker=require_commit_marker,
    )
    metadata = reader.read_metadata()
    entries = metadata.state_dict_metadata
    _check_destination(reader.location, Location(dst, storage_options), overwrite)
    sizes = {
        fqn: numel(md.size) * md.properties.dtype.itemsize if isinstance(md, TensorStorageMetadata) else 0
        for fqn, md in entries.items()
    }
    check_records_held(reader, [fqn for fqn, md in entries.items() if isinstance(md, TensorStorageMetadata)])  # before allocating
    total, done = sum(sizes.values()), 0
    # every bytes item in one load, checked before anything is written, then held until written
    raw_planner = _RawBytesLoadPlanner()
    dcp.load({fqn: None for fqn, md in entries.items() if not isinstance(md, TensorStorageMetadata)},
             storage_reader=reader, planner=raw_planner)
    if not allow_unsafe_bytes:
        for fqn, data in raw_planner.raw.items():
            safe_load_bytes(data, f"{reader.location.url}: key {fqn!r}", UNSAFE_OPT_OUT)

    def fetch(fqn: str) -> torch.Tensor | io.BytesIO:
        nonlocal done
        md = entries[fqn]
        if isinstance(md, TensorStorageMetadata):
            state: dict[str, Any] = {fqn: torch.empty(md.size, dtype=md.properties.dtype)}
            dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner())
            value: torch.Tensor | io.BytesIO = state[fqn]
        else:
            value = io.BytesIO(raw_planner.raw.pop(fqn))
        done += sizes[fqn]
        if progress is not None:
            progress(done, total)
        return value

    plan_state = {
        fqn: torch.empty(md.size, dtype=md.properties.dtype, device="meta")
        if isinstance(md, TensorStorageMetadata)
        else io.BytesIO()
        for fqn, md in entries.items()
    }
    writer = ShardWriter(dst, thread_count=1, storage_options=storage_options, overwrite=overwrite)
    dcp.save(plan_state, storage_writer=writer, planner=_StreamingSavePlanner(fetch, metadata.planner_data))
    return ConvertReport(len(entries), total, [COMMON_PT] if reader.location.exists(COMMON_PT) else [])
