"""ShardReader: a DCP StorageReader that reads only the bytes a load needs, in parallel."""

from __future__ import annotations

import dataclasses
import io
import math
import os
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from itertools import repeat
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.futures import Future

from dcp_ext.errors import CheckpointError, CorruptCheckpointError, InvalidRequestError
from dcp_ext.formats.faults import file_too_short
from dcp_ext.formats.index import IndexedItems, StoredItem
from dcp_ext.formats.marker import MARKER_NAME
from dcp_ext.formats.transforms import record_limit
from dcp_ext.formats.validate import overlapping_boxes
from dcp_ext.formats.torch_record import RecordLayouts, TensorLayout, archive_crc_fault, dense_layout, numel
from dcp_ext.observe import LOAD_PHASES, LoadReport, PhaseClock, ReportCallback, publish
from dcp_ext.runtime.gc_pause import gc_paused
from dcp_ext.runtime import options
from dcp_ext.runtime.threads import cores_per_rank, io_thread_count
from dcp_ext.storage.bytes_guard import SafeBytesPlanner
from dcp_ext.storage.catalog import METADATA_CACHE, METADATA_NAME, Catalog, rank_metadata_name, read_rank_catalog
from dcp_ext.storage.catalog_formats import FORMATS, open_catalog, replaced_since_read, with_views
from dcp_ext.storage.direct_pieces import DirectPieces, FileSpan, direct_pieces, record_spans
from dcp_ext.storage.executors import (
    DEFAULT_BUDGET_BYTES,
    EXECUTORS,
    LoadIdentity,
    ReadSettings,
)
from dcp_ext.storage.location import Location
from dcp_ext.storage.read_plan import (
    SLAB_BYTES,
    GuessedLayout,
    Request,
    StraightRecords,
    copy_record_box,
    guessed_record_request,
    raise_if_corrupt,
    straight_start,
    tensor_requests,
    whole_record_request,
)
from dcp_ext.storage.read_columns import Box, TensorReads
from dcp_ext.storage.shared_metadata import open_shared_catalog

if TYPE_CHECKING:
    from dcp_ext.megatron.base import MegatronOptions

REMOTE_WHOLE_RECORD_BYTES = 8 << 20  # largest stock record read whole from a networked store (one request)


@dataclasses.dataclass
class ReadStats:
    """Figures of the last load through one reader (reset when a load starts).

    They feed the load's ``LoadReport``, which adds the per-phase seconds.
    """

    bytes_read: int = 0
    files_opened: int = 0
    metadata_reads: int = 0
    items_read: int = 0
    seconds: float = 0.0
    bytes_received: int = 0  # two-stage loads: from other ranks instead of storage


class ShardReader(StorageReader):
    """Reads DCP checkpoints written by ShardWriter or by stock DCP, Megatron checkpoints
    (torch_dist, zarr, legacy) and safetensors, all through one path: the directory's
    format becomes a catalog of byte ranges (``catalog_formats``), which an executor reads
    (``executors``: local scatter reads, or the two-stage exchange).

    Args:
        path: local directory or fsspec URL.
        thread_count: parallel reads per rank (default: two per core the rank can count
            on, one per core for a load whose bytes the page cache holds, which then waits
            for nothing but their copy; with one, the calling thread reads).
        verify_checksums: check every byte read against its recorded checksum.
        cache_metadata: share parsed metadata with every reader in this process.
        require_commit_marker: refuse a checkpoint of ours whose commit marker is missing
            or does not match ``.metadata`` (a save interrupted or still running). Default
            None: required on stores without atomic rename (every fsspec URL), where the
            marker is the commit point; local disks commit by rename. Stock checkpoints
            carry no index and no marker and are always readable.
        storage_options: passed to fsspec for URLs.
        megatron: how to read Megatron checkpoints (torch_dist, zarr, legacy mp_rank files),
            which are detected from the directory; see ``dcp_ext.megatron.MegatronOptions``.
        two_stage: read every stored byte range once per ``group`` and exchange it with
            torch.distributed (see ``dcp_ext.exchange.two_stage``); needs an initialized
            process group; applies to every format.
        share_metadata: one rank of ``group`` reads the checkpoint's metadata files and
            sends them to the others, which decode them (``dcp_ext.storage.shared_metadata``):
            storage sees one metadata read per group instead of one per rank. Every rank of
            the group must call ``read_metadata`` together, as ``dcp.load`` does; DCP
            checkpoints only (ours, stock, Megatron torch_dist).
        group: the process group of ``two_stage`` and ``share_metadata`` (default: the whole
            job; pass the data-parallel group to mirror Megatron, or the group given to
            ``dcp.load`` when it runs on a sub-group). Given with neither, an error.
        exchange_budget_bytes: bytes of stored data in flight per two-stage batch (default
            256 MiB); given without ``two_stage=True``, an error.
        allow_unsafe_bytes: skip the check of non-tensor (bytes) items. By default every
            one is decoded by the restricted loader before any planner sees it (DCP's
            ``DefaultLoadPlanner`` would unpickle it with ``weights_only=False``) and a
            refused one raises ``UnsafeCheckpointError``; pass True only for checkpoints you
            trust. ``ShardLoadPlanner(allow_unsafe_bytes=True)`` counts as the same opt-out.
        on_report: called with this rank's ``LoadReport`` when its part of a load ends
            (see ``dcp_ext.observe``); the latest is also kept as ``last_report``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int | None = None,
        verify_checksums: bool = False,
        cache_metadata: bool = True,
        require_commit_marker: bool | None = None,
        storage_options: dict[str, Any] | None = None,
        megatron: MegatronOptions | None = None,
        two_stage: bool = False,
        share_metadata: bool = False,
        group: dist.ProcessGroup | None = None,
        exchange_budget_bytes: int | None = None,
        on_report: ReportCallback | None = None,
        allow_unsafe_bytes: bool = False,
    ):
        super().__init__()
        self.storage_options = storage_options
        if megatron is not None and not callable(getattr(megatron, "given", None)):
            raise InvalidRequestError(f"ShardReader(megatron=...) must be a MegatronOptions or None, got {megatron!r}")
        self.megatron = megatron  # options of the Megatron formats (None: their defaults)
        self.location = Location(path, storage_options)
        self.thread_count = io_thread_count(thread_count, "ShardReader")
        # a load whose bytes are all in the page cache: one thread per core (ScatterReads.run)
        self.in_memory_thread_count = self.thread_count if thread_count is not None else cores_per_rank()
        self.verify_checksums = options.flag("ShardReader", "verify_checksums", verify_checksums)
        self.cache_metadata = options.flag("ShardReader", "cache_metadata", cache_metadata)
        self.require_commit_marker = options.flag("ShardReader", "require_commit_marker", require_commit_marker, optional=True)
        self.two_stage = options.flag("ShardReader", "two_stage", two_stage)
        self.share_metadata = options.flag("ShardReader", "share_metadata", share_metadata)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise InvalidRequestError(f"ShardReader(group=...) must be a torch.distributed ProcessGroup or None, got {group!r}")
        if group is not None and not (two_stage or share_metadata):
            raise InvalidRequestError(
                "ShardReader(group=...) is the group of two_stage=True or share_metadata=True; with neither it "
                "would be ignored"
            )
        self.group = group
        if exchange_budget_bytes is not None and not two_stage:
            raise InvalidRequestError("ShardReader(exchange_budget_bytes=...) is the budget of two_stage=True; without it, it would be ignored")
        self.exchange_budget_bytes = options.positive_int(
            "ShardReader", "exchange_budget_bytes", DEFAULT_BUDGET_BYTES if exchange_budget_bytes is None else exchange_budget_bytes
        )
        self.allow_unsafe_bytes = options.flag("ShardReader", "allow_unsafe_bytes", allow_unsafe_bytes)
        self.stats = ReadStats()
        self.clock = PhaseClock(LOAD_PHASES)
        self.on_report = options.callback("ShardReader", "on_report", on_report)
        self.last_report: LoadReport | None = None
        self._mode_sent = False  # this rank's load plan carries its ReaderMode (prepare_local_plan)
        self.catalog: Catalog | None = None
        self._metadata_error: CheckpointError | None = None  # the last read_metadata() failure, for DCP's retry with rank=
        self.rank = 0
        self.is_coordinator = False
        self.load_id = uuid.uuid4().hex  # as stock readers: one per load, in read_metadata's storage_meta

    # -- DCP protocol ---------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.location = Location(checkpoint_id, self.storage_options)
        self.load_id = uuid.uuid4().hex
        self.catalog = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Every rank calls this first in a load, so the load's figures start here."""
        self.stats = ReadStats()
        self.clock = PhaseClock(LOAD_PHASES)
        rank = kwargs.get("rank")
        with self.clock.phase("metadata"):
            try:
                metadata = self._open_metadata(rank)
            except CheckpointError as exc:
                if rank is None or self._metadata_error is None or self._has_rank_metadata(rank):
                    self._metadata_error = exc if rank is None else None
                    raise
                # DCP asks for per-rank metadata after any failure: the first one is the one to report
                raise self._metadata_error from None
        self._metadata_error = None
        self.stats.seconds += self.clock.seconds["metadata"]
        return metadata

    def _has_rank_metadata(self, rank: int) -> bool:
        """Whether the rank's own metadata file is there; no when the storage cannot tell
        (an object store that does not answer failed the first read too)."""
        try:
            return self.location.exists(rank_metadata_name(rank))
        except CheckpointError:
            return False

    def _open_metadata(self, rank: int | None) -> Metadata:
        """``rank``: DCP asks for that rank's own metadata when ``.metadata`` is missing (a
        stock ``dcp.save(use_collectives=False)`` writes one per rank); the load then runs
        without collectives."""
        for option, on, what in (
            ("two_stage", self.two_stage, "exchanges bytes"),
            ("share_metadata", self.share_metadata, "sends the metadata"),
        ):
            if on and not dist.is_initialized():
                raise InvalidRequestError(
                    f"{self.location.url}: ShardReader({option}=True) {what} between ranks and needs an "
                    "initialized torch.distributed process group"
                )
            if on and rank is not None:
                raise InvalidRequestError(
                    f"{self.location.url}: ShardReader({option}=True) {what} between ranks, but this checkpoint "
                    f"has per-rank metadata ({rank_metadata_name(rank)}, a dcp.save(use_collectives=False)) that "
                    "each rank loads alone"
                )
        if rank is not None:
            self.catalog, was_read = with_views(self.location, read_rank_catalog(self.location, rank), self.megatron), True
        elif self.share_metadata:
            self.catalog, was_read = open_shared_catalog(self.location, self.group, self.cache_metadata, self.megatron)
        else:
            self.catalog, was_read = open_catalog(self.location, self.cache_metadata, self.megatron)
        self.stats.metadata_reads += int(was_read)
        if self.verify_checksums and not FORMATS[self.catalog.format].checksums:
            raise InvalidRequestError(
                f"{self.location.url}: verify_checksums=True, but a {self.catalog.format} checkpoint records no "
                "checksums to verify against; load it with verify_checksums=False"
            )
        self._check_committed(self.catalog)
        metadata = self.catalog.metadata
        return dataclasses.replace(metadata, storage_meta=self._storage_meta(metadata.storage_meta))

    def _storage_meta(self, saved: Any) -> StorageMeta:
        """The checkpoint's ``StorageMeta`` with this load's id and where it is loaded from
        (a planner's errors name it), rebuilt from the fields it has: a ``.metadata`` whose
        pickle lost one (stock never reads them) loads, as with stock."""
        fields = dataclasses.fields(StorageMeta)
        kept = {f.name: getattr(saved, f.name) for f in fields if isinstance(saved, StorageMeta) and hasattr(saved, f.name)}
        return StorageMeta(**{**kept, "checkpoint_id": self.location.url, "load_id": self.load_id})

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        if self._exchanges_in_job() and "rank" in kwargs and kwargs["rank"] != dist.get_rank():
            raise self._subgroup_error()  # in DCP's local step: raised on every rank of its group
        if self.catalog is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Each rank's plan says whether its reader exchanges (unless the planner uses the
        plan's storage data itself), so that the coordinator can refuse a group whose ranks
        disagree: their collectives would pair with DCP's own and leave ranks waiting."""
        self._mode_sent = plan.storage_data is None
        if not self._mode_sent:
            return plan
        return dataclasses.replace(plan, storage_data=ReaderMode(self.two_stage, takes_columns=self._takes_columns()))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self._exchanges_in_job() and len(plans) != dist.get_world_size():
            raise self._subgroup_error()  # a sub-group of ranks 0..k-1: their DCP ranks are their own
        exchanging = [isinstance(plan.storage_data, ReaderMode) and plan.storage_data.two_stage for plan in plans]
        if any(exchanging) and not all(exchanging):
            raise InvalidRequestError(
                f"{self.location.url}: ShardReader(two_stage=True) on ranks {[r for r, on in enumerate(exchanging) if on]} "
                f"of dcp.load's group but not on ranks {[r for r, on in enumerate(exchanging) if not on]} (two_stage=False "
                "or another reader); every rank must pass the same reader options"
            )
        return [
            dataclasses.replace(plan, storage_data=dataclasses.replace(plan.storage_data, checked=True))
            if isinstance(plan.storage_data, ReaderMode) else plan
            for plan in plans
        ]

    @gc_paused()  # a plan of thousands of items builds tens of thousands of objects, no garbage
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        started = time.perf_counter()
        self.clock.charge_rest("plan")
        planned_by = planner  # the planner itself, before the bytes-checking wrapper
        self._check_mode_confirmed(plan)
        planner = self._bytes_checked(planner)
        catalog = self._require_catalog()
        settings = ReadSettings(self.location, self.thread_count, self._missing, self.group, self.exchange_budget_bytes,
                                in_memory_thread_count=self.in_memory_thread_count)
        executor = EXECUTORS["two_stage" if self.two_stage else "local"](settings)
        identity = LoadIdentity(self.location.cache_key(), catalog.fingerprint)
        commits: list[Callable[[], None]] = []
        try:
            items, direct = self._direct_pieces(catalog, plan)
            stored = self._stored(catalog, [item.storage_index for item in items])
            self._check_destinations_filled(catalog, items, direct, planned_by)
            spans = record_spans(((item.storage_index.fqn, record) for item, record in zip(items, stored)), dict(direct.spans))
            self._check_files(spans)
            requests: Iterable[Request] = self._requests(catalog, items, stored, direct, planner, commits)
            if executor.collective:  # planned whole first, so that a failure can be shared
                requests = list(requests)
        except Exception as exc:
            if executor.collective:  # every rank must join, which shares the failure
                executor.run([], identity, planning_error=exc)  # raises it on every rank
            raise
        bytes_read, files = executor.run(
            requests,
            identity,
            expected_bytes=sum(record.length for record in stored) + direct.nbytes,
            expected_files=len(spans),
            in_memory=not self.two_stage and self._in_memory(spans),
        )
        self.clock.add("exchange", executor.seconds)
        self.stats.bytes_received += executor.bytes_received
        for commit_item in commits:
            commit_item()
        return self._finish_read(len(stored) + len(direct), bytes_read, files, started)

    def _direct_pieces(self, catalog: Catalog, plan: LoadPlan) -> tuple[list[ReadItem], DirectPieces]:
        """The plan's ReadItems, and the pieces of its columns (``read_columns``) read
        without one (``direct_pieces``). Any other piece becomes a ReadItem, as do all of
        columns made from another index."""
        reads = plan.planner_data
        if not isinstance(reads, TensorReads):
            return list(plan.items), DirectPieces.none()
        if reads.keys is not catalog.metadata.state_dict_metadata or not isinstance(catalog.items, IndexedItems):
            return list(plan.items) + reads.read_items(), DirectPieces.none()
        others, direct = direct_pieces(reads, catalog.items, self.verify_checksums)
        return list(plan.items) + [reads.read_item(piece) for piece in others], direct

    def _takes_columns(self) -> bool:
        """Whether this reader's ``read_data`` reads a plan's tensor pieces as columns:
        ours, unless a subclass reads itself, and unless a rank reads its own TP-replica
        copies (the columns name the canonical records)."""
        return type(self).read_data is ShardReader.read_data and (self.two_stage or not self._require_catalog().copies)

    def _check_mode_confirmed(self, plan: LoadPlan) -> None:
        """A two-stage rank whose plan the coordinator did not stamp raises before any
        exchange: the coordinator loads with another reader, which cannot have checked that
        every rank exchanges (raised here, DCP hands the error to every rank)."""
        mode = plan.storage_data
        if self.two_stage and self._mode_sent and not (isinstance(mode, ReaderMode) and mode.checked):
            raise InvalidRequestError(
                f"{self.location.url}: ShardReader(two_stage=True) on this rank, but dcp.load's coordinator did not "
                "confirm that every rank of its group exchanges (it loads with another reader, or the planner's "
                "finish_plan dropped the plan's storage_data); every rank must pass the same reader options"
            )

    def _exchanges_in_job(self) -> bool:
        """Whether this load exchanges within the whole job (two_stage=True without group=)."""
        return self.two_stage and self.group is None and dist.is_initialized()

    def _subgroup_error(self) -> InvalidRequestError:
        """DCP does not tell a reader its process group; a sub-group shows in the ranks it
        reports (and in the number of plans): refused before the first exchange, which would
        wait for ranks that never join."""
        return InvalidRequestError(
            f"{self.location.url}: ShardReader(two_stage=True) without group= exchanges within the whole job, "
            "but dcp.load runs on a sub-group (or in one process, no_dist=True); pass ShardReader(group=...) the "
            "process group given to dcp.load, or load without two_stage"
        )

    def _bytes_checked(self, planner: LoadPlanner) -> LoadPlanner:
        """The planner every read path calls: bytes items pass the restricted loader first,
        unless the caller opted out here or with ``ShardLoadPlanner(allow_unsafe_bytes=True)``."""
        if self.allow_unsafe_bytes or getattr(planner, "allow_unsafe_bytes", False) is True:
            return planner
        return cast(LoadPlanner, SafeBytesPlanner(planner, self._bytes_where))

    def _bytes_where(self, read_item: ReadItem) -> str:
        index = read_item.storage_index
        return self._where(self._stored(self._require_catalog(), [index])[0].relative_path, index.fqn)

    def _stored(self, catalog: Catalog, indices: list[MetadataIndex]) -> list[StoredItem]:
        """The records a load reads: this rank's TP-replica copies where it has them, but
        the canonical records in a two-stage load, where the group reads each record once
        and ranks asking for their own copies would share nothing."""
        return catalog.stored_items(indices, None if self.two_stage else self.rank)

    def _requests(
        self,
        catalog: Catalog,
        items: list[ReadItem],
        stored: list[StoredItem],
        direct: DirectPieces,
        planner: LoadPlanner,
        commits: list[Callable[[], None]],
    ) -> Iterator[Request]:
        """Byte-range requests for the plan's items and direct pieces, file by file in
        file order, and what to commit once they land. A generator: the executor reads one
        file while the next is planned."""
        item_files: dict[str, list[int]] = {}
        for i in sorted(range(len(stored)), key=lambda i: (stored[i].relative_path, stored[i].offset)):
            item_files.setdefault(stored[i].relative_path, []).append(i)
        on_host = bool(item_files) and _on_host(planner)
        for path in sorted(item_files.keys() | direct.by_file.keys()):
            mine, theirs = item_files.get(path, []), direct.by_file.get(path, [])
            layouts = iter(self._layouts(catalog, [items[i] for i in mine], [stored[i] for i in mine], on_host))
            straight = StraightRecords(path)
            for is_direct, i in _in_record_order(stored, mine, direct, theirs):
                if not is_direct:
                    yield from self._plan_item(catalog, items[i], stored[i], next(layouts), planner, commits, straight)
                    continue
                landing = direct.straight[i]
                if landing is not None:
                    yield from straight.add(direct.fqn(i), direct.payloads[i], landing)
                    continue
                yield from straight.flush()  # the requests stay in file order
                yield from self._direct_requests(direct, i)
            yield from straight.flush()

    def _in_memory(self, spans: dict[str, FileSpan]) -> bool:
        """Whether the page cache holds each file's span the load reads
        (``RangeReader.in_memory``); no where that cannot be asked, or a file cannot be
        opened (its reads say why)."""
        try:
            for path, span in spans.items():
                with self.location.open_reader(path) as reader:
                    if not reader.in_memory(span.start, span.end):
                        return False
        except (OSError, CheckpointError):
            return False
        return True

    def _direct_requests(self, direct: DirectPieces, position: int) -> list[Request]:
        """Requests of a direct piece that does not go straight (``DirectPieces.straight``):
        its record's layout from the index, its memory from the planner's landing tensor;
        nothing to commit (the planner's ``commit_tensor`` is DCP's, which does nothing)."""
        reads, piece, record = direct.reads, direct.pieces[position], direct.record(position)
        shard = reads.shard[piece]
        fqn, dtype, lengths = reads.fqns[shard], reads.dtypes[shard], reads.lengths[piece]
        where = self._where(record.relative_path, fqn)
        dest = reads.destination(piece)
        if dest.shape != lengths:
            raise CheckpointError(f"{where}: destination has shape {list(dest.shape)} but the plan reads {list(lengths)}")
        layout = dense_layout(record.payload_offset - record.offset, dtype, reads.saved_sizes[piece])
        return tensor_requests(record, layout, reads.storage_offsets[piece], lengths, dest, fqn, where, self.verify_checksums)

    def _finish_read(self, count: int, bytes_read: int, files: set[str], started: float) -> Future[None]:
        self.stats.bytes_read += bytes_read
        self.stats.files_opened += len(files)
        self.stats.items_read += count
        self.stats.seconds += time.perf_counter() - started
        self.clock.charge_rest("read")
        self._publish()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _publish(self) -> None:
        """Report this rank's load, from the stats and the phase clock."""
        self.last_report = LoadReport(
            checkpoint=self.location.url,
            rank=self.rank,
            is_coordinator=self.is_coordinator,
            seconds=self.clock.totals(),
            bytes_read=self.stats.bytes_read,
            bytes_received=self.stats.bytes_received,
            files_opened=self.stats.files_opened,
            items_read=self.stats.items_read,
            metadata_reads=self.stats.metadata_reads,
        )
        publish(self.last_report, self.on_report)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- planning ------------------------------------------------------------------------
    def _require_catalog(self) -> Catalog:
        if self.catalog is None:
            self.read_metadata()
        assert self.catalog is not None
        return self.catalog

    def _check_committed(self, catalog: Catalog) -> None:
        required = not self.location.is_local if self.require_commit_marker is None else self.require_commit_marker
        if required and not catalog.committed:
            self.catalog = None
            raise CheckpointError(
                f"{self.location.url}: checkpoint is not committed: no commit marker ({MARKER_NAME}) matches "
                f"{METADATA_NAME}, so a save into it was interrupted or is still running. Pass "
                "require_commit_marker=False (dcp-ext convert: --allow-uncommitted) to load it anyway (its data "
                f"files were all written before {METADATA_NAME})"
            )

    def _check_destinations_filled(self, catalog: Catalog, items: list[ReadItem], direct: DirectPieces, planner: LoadPlanner) -> None:
        """Every element of each tensor the load fills is read exactly once. DCP plans reads
        for the parts of a destination some chunk covers and leaves the rest as it was,
        silently (as stock does): a checkpoint one process saved alone (``dcp.save(no_dist=
        True)`` of its own shards, a per-rank ``.metadata``) loaded into another layout, or
        a ``.metadata`` whose chunks leave a gap; chunks overlapping each other fill
        elements twice, from two records. Both refused by key: one pass over the plan,
        and a sweep of the boxes of the destinations read in several pieces. Only for the
        planners that plan every element (DCP's own, ours): a planner of one's own may read
        less on purpose (a resized vocabulary keeping its new rows)."""
        state = getattr(planner, "state_dict", None)
        if not isinstance(state, dict) or not _plans_every_element(planner):
            return
        read: dict[str, int] = {}
        pieces: dict[tuple[str, int | None], list[tuple[Box, Box]]] = {}  # boxes read into each destination chunk
        as_bytes: set[str] = set()  # stored numbers put into 0-d tensors
        for item in items:
            fqn = item.dest_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                as_bytes.add(fqn)
            else:
                read[fqn] = read.get(fqn, 0) + math.prod(item.lengths)
                pieces.setdefault((fqn, item.dest_index.index), []).append((tuple(item.dest_offsets), tuple(item.lengths)))
        # a key whose one shard one piece fills whole has nothing to add up: no ReadItem reads
        # into it (a piece read as one counts in its shard, ``direct_pieces``; the plan's own
        # items are never a shard's), and the key needs what that piece reads
        filled = direct.filled
        reads = direct.reads
        for position in direct.partial:
            piece = direct.pieces[position]
            shard, lengths = reads.shard[piece], reads.lengths[piece]
            fqn = reads.fqns[shard]
            read[fqn] = read.get(fqn, 0) + math.prod(lengths)
            pieces.setdefault((fqn, reads.chunk_places[shard]), []).append((reads.dest_offsets[piece], lengths))
        for (fqn, _), boxes in pieces.items():
            if len(boxes) == 1:
                continue
            overlap = overlapping_boxes(boxes)
            if overlap:
                raise CorruptCheckpointError(
                    f"{self.location.url}: key {fqn!r}: the checkpoint's chunks overlap each other (damaged metadata): "
                    f"their reads into this rank's destination at {list(overlap[0][0])} and {list(overlap[0][1])} "
                    "share elements"
                )
        saved = catalog.metadata.state_dict_metadata
        for fqn, value in state.items():
            if fqn in filled:
                continue
            needed = _local_elements(value)
            if needed is None or fqn in as_bytes or (fqn not in read and fqn not in saved):
                continue
            got = read.get(fqn, 0)
            if got >= needed:  # more only where reads overlap, refused above
                continue
            where = f"{self.location.url}: key {fqn!r}"
            if catalog.saving_rank is not None:
                raise InvalidRequestError(
                    f"{where}: {rank_metadata_name(catalog.saving_rank)} (a dcp.save(use_collectives=False)) describes "
                    f"only what rank {catalog.saving_rank} saved, {got} of the {needed} elements this rank's destination "
                    "needs; such a checkpoint loads at the saving world size, each rank into the layout it saved"
                )
            raise CheckpointError(
                f"{where}: the checkpoint holds {got} of the {needed} elements this rank's destination needs; the rest "
                "would keep their old values. A checkpoint one process saved alone (dcp.save(no_dist=True) of its own "
                "shards) loads into the layout it saved; otherwise its metadata is damaged"
            )

    def _missing(self, path: str, key: str) -> CheckpointError:
        """The error for a data file that is gone: a concurrent save retired it, or it was lost.

        Either way the cached metadata is dropped, so the next load reads it again."""
        catalog = self._require_catalog()
        METADATA_CACHE.evict(catalog)
        if replaced_since_read(self.location, catalog, self.megatron):
            return CheckpointError(
                f"{self._where(path, key)}: data file is gone because a newer save was committed into "
                "this directory while the load ran; load again to get the new checkpoint"
            )
        return CheckpointError(f"{self._where(path, key)}: data file is missing")

    def _where(self, path: str, key: str) -> str:
        return f"{self.location.url}: file {path!r} key {key!r}"

    def _check_files(self, spans: dict[str, FileSpan]) -> None:
        """Every file of these spans (``record_spans``) exists and holds every byte range
        they touch; in a format whose records are whole files (zarr chunks), exactly
        those bytes: a longer file is another array's chunk or a shifted one, not this record."""
        whole_files = FORMATS[self._require_catalog().format].records_fill_files
        for path, (_, end, key) in spans.items():
            self.location.path(path, key)  # rejects escapes
            size = self.location.size(path)
            if size is None:
                raise self._missing(path, key)
            if end > size:
                raise file_too_short(self._where(path, key), end, size)
            if whole_files and end != size:
                raise CorruptCheckpointError(
                    f"{self._where(path, key)}: the file holds {size} bytes, but its record is {end} bytes (the "
                    "array's chunk shape times its dtype size); a chunk file holds exactly one chunk"
                )

    def _layouts(
        self, catalog: Catalog, items: list[ReadItem], stored: list[StoredItem], on_host: bool = False
    ) -> list[TensorLayout | GuessedLayout | None]:
        """The tensor layout of each plan item's record (None: read whole, a bytes item, a
        transformed record, or a stock record on a networked store that ``_cheaper_whole``
        picks). Stock records are parsed once each, all from one open file and most
        recognized by their frame (``Catalog.parse_layouts``): the items are one file's.
        Where the page cache lacks them (local files; a store's ends are fetched together,
        as before), every destination is in host memory (``on_host``: a device's reads go
        through staging, the records' layouts known first) and each rank reads for itself
        (a two-stage load exchanges the payloads' bytes alone), a stock record read whole,
        of a length, dtype and shape this file has already shown (``_kind``), is not parsed
        first but guessed to be framed as that one, and its read checks the guess
        (``GuessedLayout``): only the first record of each kind is read ahead of the data,
        which then streams from the disk."""
        layouts: list[TensorLayout | GuessedLayout | None] = []
        missing: dict[Any, tuple[MetadataIndex, list[int]]] = {}  # by place: records whose layout the metadata does not give
        # (a verified read keeps to the probe: it tells a record that carries no CRC-32 from a corrupt one)
        networked = self.location.networked and catalog.format == "dcp" and not self.verify_checksums
        guessing = on_host and catalog.format == "dcp" and not (self.verify_checksums or self.two_stage) and self.location.is_local
        cold: bool | None = None  # whether the page cache lacks the file's first record whose layout is unknown
        firsts: dict[tuple[Any, ...], Any] = {}  # kind -> the place of the first record of it (parsed)
        guessed: dict[tuple[Any, ...], list[int]] = {}  # kind -> the positions of the others
        for read_item, record in zip(items, stored):
            layout = None
            if read_item.type != LoadItemType.BYTE_IO and not record.transforms:
                index = read_item.storage_index
                layout = catalog.known_layout(index, record)
                if layout is None and networked and self._cheaper_whole(catalog, read_item, record):
                    layouts.append(None)
                    continue
                kind = None
                if guessing and layout is None:
                    if cold is None:  # asked once: warm, the ends come from memory faster than a parse as each record lands
                        cold = not self._held(record)
                    kind = self._kind(catalog, read_item, record) if cold else None
                if kind in firsts:
                    guessed[kind].append(len(layouts))
                    layouts.append(None)
                    continue
                if layout is None or (self.verify_checksums and record.checksum is None and (
                        layout.payload_crc32 is None or catalog.parsed_before(index))):
                    # a verified read of a record without CRC32C in the index checks its zip CRC-32 as
                    # the record holds it now: our index gives no CRC-32 (checksums=False), and one
                    # parsed by an earlier load is stale where the data file alone was replaced
                    place = (index.fqn, index.offset)
                    missing.setdefault(place, (index, []))[1].append(len(layouts))
                    if kind is not None:
                        firsts[kind], guessed[kind] = place, []
            layouts.append(layout)
        records = RecordLayouts()
        found = dict(zip(missing, self._parse_layouts(catalog, [index for index, _ in missing.values()], records, cold)))
        for place, (_, positions) in missing.items():
            for i in positions:  # a layout the index gave keeps its offsets (a TP-replica copy's own), takes the CRC
                known = layouts[i]
                layouts[i] = found[place] if known is None else dataclasses.replace(known, payload_crc32=found[place].payload_crc32)
        unguessed: list[int] = []  # records of a kind no straight read takes: parsed after all
        for kind, positions in guessed.items():
            first = found[firsts[kind]]
            if first.is_row_major() and not (first.conj or first.neg):
                guess = GuessedLayout(dataclasses.replace(first, payload_crc32=None), records)
                for i in positions:
                    layouts[i] = guess
            else:
                unguessed += positions
        for i, layout in zip(unguessed, self._parse_layouts(catalog, [items[i].storage_index for i in unguessed], records, cold)):
            layouts[i] = layout
        return layouts

    def _held(self, record: StoredItem) -> bool:
        """Whether the page cache holds the start of ``record`` (``RangeReader.holds``)."""
        try:
            with self.location.open_reader(record.relative_path) as reader:
                return reader.holds([record.offset])
        except OSError:  # the reads say why
            return True

    def _parse_layouts(
        self, catalog: Catalog, indices: list[MetadataIndex], records: RecordLayouts, cold: bool | None = None
    ) -> list[TensorLayout]:
        try:
            return catalog.parse_layouts(self.location, indices, self.thread_count, records, cold)
        except FileNotFoundError:  # the records parsed here: stock ones, or the canonical record of one of ours
            raise self._missing(catalog.item(indices[0]).relative_path, indices[0].fqn) from None

    @staticmethod
    def _kind(catalog: Catalog, read_item: ReadItem, record: StoredItem) -> tuple[Any, ...] | None:
        """(length, dtype, shape) of a record read whole into one slab (``guessed_record_request``); None otherwise."""
        md, chunk = catalog.chunk(read_item.storage_index)
        sizes = tuple(chunk.sizes)
        if tuple(read_item.lengths) != sizes or any(read_item.storage_offsets):
            return None
        if numel(sizes) * md.properties.dtype.itemsize > SLAB_BYTES:
            return None
        return record.length, md.properties.dtype, sizes

    @staticmethod
    def _cheaper_whole(catalog: Catalog, read_item: ReadItem, record: StoredItem) -> bool:
        """Whether a stock record on a networked store is read whole rather than probed:
        a small one the read needs whole (all of it but its zip headers), whose two ends
        would be a round trip before its bytes could be asked for (stock reads a record in
        one request). A larger record, or a part of a chunk (a resharded load), is read
        into its destination, after the ends of the file's records were fetched together
        (``parse_layouts``): a whole record is held in memory until its box is copied out."""
        if record.length > REMOTE_WHOLE_RECORD_BYTES:
            return False
        return tuple(read_item.lengths) == tuple(catalog.chunk(read_item.storage_index)[1].sizes)

    def _plan_item(
        self,
        catalog: Catalog,
        read_item: ReadItem,
        stored: StoredItem,
        layout: TensorLayout | GuessedLayout | None,
        planner: LoadPlanner,
        commits: list[Callable[[], None]],
        straight: StraightRecords,
    ) -> Iterable[Request]:
        """The requests of a plan item, in file order after those ``straight`` holds; a
        whole record that lands as it is in memory of its own (most of a stock checkpoint's)
        joins ``straight`` (one request for tens of records, as direct pieces do): a warm
        load of 1,180 stock records 91.9 -> 89.4 and 95.3 -> 93.6 ms (alternating)."""
        index = read_item.storage_index
        if catalog.inline and index in catalog.inline:  # a bytes item the format synthesized: nothing to read
            data = catalog.inline[index]
            commits.append(lambda: planner.load_bytes(read_item, io.BytesIO(data)))
            return ()
        where = self._where(stored.relative_path, index.fqn)
        if layout is None:  # a bytes item, a transformed record, a stock one on a networked store (``_layouts``)
            return [*straight.flush(), self._plan_whole_record(stored, read_item, planner, where, commits)]
        dest = self._destination(read_item, planner, where)
        commits.append(lambda: planner.commit_tensor(read_item, dest))
        lengths = tuple(read_item.lengths)
        if isinstance(layout, GuessedLayout):
            if straight_start(stored, layout.layout, lengths, dest, self.verify_checksums) is None:
                # host memory of another dtype or layout: the record read whole and copied out, still no read of its ends first
                return [*straight.flush(), self._whole_record_into(stored, read_item, dest, where)]
            md, chunk = catalog.chunk(index)
            learned = lambda found: catalog.learn_layout(index, found)  # noqa: E731
            return [*straight.flush(), guessed_record_request(
                stored, layout, (md.properties.dtype, tuple(chunk.sizes)), dest, index.fqn, where, learned)]
        start = straight_start(stored, layout, lengths, dest, self.verify_checksums)
        if start is not None and not (layout.conj or layout.neg) and dest.nbytes <= SLAB_BYTES:
            return straight.add(index.fqn, start, dest)
        return [*straight.flush(), *tensor_requests(
            stored, layout, tuple(read_item.storage_offsets), lengths, dest, index.fqn, where, self.verify_checksums
        )]

    def _plan_whole_record(
        self, stored: StoredItem, read_item: ReadItem, planner: LoadPlanner, where: str, commits: list[Callable[[], None]]
    ) -> Request:
        """Bytes items, records stored through stream transforms and small stock records a
        load from a networked store needs whole (``_cheaper_whole``) are read whole; a tensor record
        is decoded (if transformed) once it lands and its box copied out right there (the
        reading thread), so only the records in flight are held. A bytes item goes to the
        planner with the commits, on the calling thread."""
        fqn = read_item.storage_index.fqn
        limit = record_limit(self._require_catalog().chunk_nbytes(read_item.storage_index)) if stored.transforms else 0
        if read_item.type == LoadItemType.BYTE_IO:  # checked whatever verify_checksums says: read whole anyway,
            landed: list[bytes | bytearray] = []  # and a record of another key decodes to a value of another type

            def land(record: bytes | bytearray) -> None:
                if stored.checksum is None:  # no CRC32C in an index: a stock record's own zip CRC-32s
                    raise_if_corrupt(where, archive_crc_fault(record)[1])
                landed.append(record)

            commits.append(lambda: planner.load_bytes(read_item, io.BytesIO(landed[0])))
            return whole_record_request(stored, fqn, where, True, land, limit)
        dest = self._destination(read_item, planner, where)
        commits.append(lambda: planner.commit_tensor(read_item, dest))
        return self._whole_record_into(stored, read_item, dest, where, limit)

    def _whole_record_into(self, stored: StoredItem, read_item: ReadItem, dest: torch.Tensor, where: str, limit: int = 0) -> Request:
        """A tensor record read whole, decoded if transformed, its box copied into ``dest`` as it lands."""
        md, chunk = self._require_catalog().chunk(read_item.storage_index)
        stored_as = (md.properties.dtype, tuple(chunk.sizes))
        box = (tuple(read_item.storage_offsets), tuple(read_item.lengths))
        copy_box = lambda record: copy_record_box(  # noqa: E731
            record, stored_as, *box, dest, where, self.verify_checksums, decoded=bool(stored.transforms))
        return whole_record_request(stored, read_item.storage_index.fqn, where, self.verify_checksums, copy_box, limit)

    def _destination(self, read_item: ReadItem, planner: LoadPlanner, where: str) -> torch.Tensor:
        dest = planner.resolve_tensor(read_item)
        if dest.requires_grad:  # what DCP's reader writes into is detached; a detach that need
            dest = dest.detach()  # not be made gives up the GIL (``host_bytes``)
        if tuple(dest.shape) != tuple(read_item.lengths):
            raise CheckpointError(
                f"{where}: destination has shape {list(dest.shape)} but the plan reads {list(read_item.lengths)}"
            )
        return dest


def _on_host(planner: LoadPlanner) -> bool:
    """Whether every tensor of the planner's state dict lives in host memory."""
    state = getattr(planner, "state_dict", None)
    return isinstance(state, dict) and all(
        getattr(getattr(value, "device", None), "type", None) == "cpu" for value in state.values() if isinstance(value, torch.Tensor)
    )


def checking_reader(path: str | os.PathLike[str], **options: Any) -> ShardReader:
    """A ``ShardReader`` that checks every checksum the checkpoint's format records, for
    copies (convert, export): a copy of damaged bytes would carry fresh checksums that
    match them. Formats that record none (Megatron zarr and legacy) are read as they are."""
    reader = ShardReader(path, **options)
    reader.read_metadata()
    reader.verify_checksums = FORMATS[reader._require_catalog().format].checksums
    return reader


def check_records_held(reader: ShardReader, keys: Collection[str]) -> None:
    """The files hold every record of ``keys``: checked before a copy allocates their tensors
    as the metadata claims them (every format's catalog checks that a record holds its chunk;
    a ``.zarray`` claiming 88 TB over two 360-byte chunk files was allocated first). Keys
    the copy leaves out are not looked at."""
    wanted = set(keys)
    reader._check_files(record_spans((index.fqn, item) for index, item in reader._require_catalog().items.items() if index.fqn in wanted))


@dataclasses.dataclass(frozen=True)
class ReaderMode:
    """What a rank's ``ShardReader`` puts in its load plan's ``storage_data``."""

    two_stage: bool
    checked: bool = False  # set by the coordinator's ShardReader once every rank's mode agreed
    takes_columns: bool = False  # its read_data reads tensor pieces as columns (``read_columns``)


def _in_record_order(stored: list[StoredItem], items: list[int], direct: DirectPieces, pieces: list[int]) -> Iterable[tuple[bool, int]]:
    """One file's plan items and direct pieces (positions, each in record order) merged by
    record: (False, item) and (True, direct piece)."""
    if not items or not pieces:
        return zip(repeat(bool(pieces)), pieces or items)
    steps = [(stored[i].offset, False, i) for i in items] + [(direct.offsets[p], True, p) for p in pieces]
    return ((is_direct, i) for _, is_direct, i in sorted(steps))


def _plans_every_element(planner: LoadPlanner) -> bool:
    """Whether the planner's local plan reads every element of each destination it loads:
    DCP's ``DefaultLoadPlanner`` and its subclasses that keep its ``create_local_plan``
    (``_EmptyStateDictLoadPlanner``, ``DynamicMetaLoadPlanner``), and a planner whose own
    ``create_local_plan`` says so (``PLANS_EVERY_ELEMENT``: ``ShardLoadPlanner``)."""
    owner = next((c for c in type(planner).__mro__ if "create_local_plan" in c.__dict__), None)
    return owner is DefaultLoadPlanner or bool(owner is not None and owner.__dict__.get("PLANS_EVERY_ELEMENT"))


def _local_elements(value: Any) -> int | None:
    """How many elements this rank's part of a state-dict value holds; None: no tensor."""
    if isinstance(value, DTensor):
        value = value._local_tensor  # to_local() would build an autograd view per key
    if isinstance(value, ShardedTensor):
        return sum(shard.tensor.numel() for shard in value.local_shards())
    if hasattr(type(value), "__create_chunk_list__"):  # DCP's hook for a tensor's local chunks (NTPShard,
        return sum(math.prod(chunk.sizes) for chunk in value.__create_chunk_list__())  # LocalShardsWrapper)
    return value.numel() if isinstance(value, torch.Tensor) else None
