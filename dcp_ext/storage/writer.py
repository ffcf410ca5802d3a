"""ShardWriter: a DCP StorageWriter with parallel writes, checksums and atomic commit."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pickle
import threading
import uuid
from typing import Any

import crc32c
from torch.distributed.checkpoint._extension import StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_ext.errors import CheckpointError, CheckpointExistsError, InvalidRequestError
from dcp_ext.formats.chunk_lists import MetadataOnDemand
from dcp_ext.formats.data_files import data_file_name
from dcp_ext.runtime.gc_pause import gc_paused
from dcp_ext.runtime import options
from dcp_ext.runtime.threads import io_thread_count, run_parallel
from dcp_ext.formats.index import QUANTIZED_DTYPES, StoredItem, encode_index
from dcp_ext.formats.replica_copy import ReplicaCopyIndex
from dcp_ext.formats.torch_record import RecordSink, numel, write_bytes, write_tensor
from dcp_ext.observe import SAVE_PHASES, PhaseClock, ReportCallback, SaveReport, publish
from dcp_ext.storage.catalog import METADATA_NAME
from dcp_ext.storage.catalog_formats import held_format
from dcp_ext.runtime.crash import crash_point
from dcp_ext.storage.cleanup import retire, wait_for_cleanup
from dcp_ext.storage.commit import commit, remove_dead_files, unreferenced
from dcp_ext.storage.device_staging import HostCopies
from dcp_ext.storage.location import Location
from dcp_ext.storage.piece_digests import check_piece_digests, split_piece_digests, with_piece_digests
from dcp_ext.storage.write_results import WrittenItems
from dcp_ext.storage.save_tracking import (
    DIRECTORY_SAVES,
    OPEN_SAVES,
    OpenSave,
    SaveOrder,
    SaveSlot,
    async_save_target,
    check_same_save,
    discard_on_failure,
    thread_in_save,
    uploads_on_a_thread,
)
from dcp_ext.storage.staging import AsyncStagingMixin
from dcp_ext.storage.writeback import PendingSyncs, early_writeback, syncs_later

DCP_METADATA_VERSION = "1.0.0"  # what torch's FileSystemWriter writes


@dataclasses.dataclass(frozen=True)
class FilePrefix:
    """What the coordinator tells each rank about the save's files."""

    rank: int
    token: str  # new per save: names every data file of it, so a failed save's files are known
    created_dir: bool  # the save created its directory: a failed save removes it when empty

    def file_name(self, n: int) -> str:
        return data_file_name(self.rank, self.token, n)


def item_nbytes(item: WriteItem) -> int:
    """Bytes this item writes: its chunk, not the global tensor (``tensor_storage_size()``
    counts the whole tensor, which weighs every shard of a sharded tensor as all of it)."""
    if item.tensor_data is None:
        return 0
    return numel(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def split_by_bytes(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over at most ``bins`` files: tensors largest first to the lightest bin."""
    bins = max(1, min(bins, len(items)))
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    loads = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    for item in sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=item_nbytes, reverse=True):
        lightest = loads.index(min(loads))
        buckets[lightest].append(item)
        loads[lightest] += item_nbytes(item)
    return [b for b in buckets if b]


COMPRESSIONS = ("zstd",)


def stream_transform(compression: str | None) -> StreamTransformExtension | None:
    """DCP's stream transform for ``compression``; an unknown name or a missing codec is an error."""
    if compression is None:
        return None
    if compression not in COMPRESSIONS:
        raise InvalidRequestError(f"ShardWriter: compression={compression!r} is not one of {COMPRESSIONS} (or None)")
    if importlib.util.find_spec("zstandard") is None and importlib.util.find_spec("pyzstd") is None:
        raise InvalidRequestError("ShardWriter: compression='zstd' needs the zstandard package (pip install zstandard)")
    return ZStandard()


class ShardWriter(AsyncStagingMixin, StorageWriter):
    """Writes stock-compatible DCP checkpoints, checksummed and committed atomically.

    Args:
        path: local directory or fsspec URL (``file://``, ``memory://``, ``s3://``...).
        thread_count: files written in parallel per rank (default: from the CPU count).
        sync_files: fsync data files, metadata and the directory.
        checksums: record a CRC32C per item in the index.
        overwrite: if False, refuse a directory that already holds a checkpoint.
        storage_options: passed to fsspec for URLs.
        on_report: called with this rank's ``SaveReport`` when its part of a save ends
            (see ``dcp_ext.observe``); the latest is also kept as ``last_report``.
        reuse_staging: None: saves started with ``writer.async_save`` stage into the same
            CPU buffers, ``dcp.async_save`` called directly into new ones; True: the same, but
            a direct ``dcp.async_save`` is refused; False: new buffers per save (see
            ``dcp_ext.storage.staging``).
        compression: ``"zstd"`` passes every record through DCP's ``ZStandard`` stream
            transform, recorded in ``.metadata`` as stock ``_extensions`` do, so stock
            readers read the checkpoint too; checksums cover the stored bytes. Needs the
            ``zstandard`` (or ``pyzstd``) package.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int | None = None,
        sync_files: bool = True,
        checksums: bool = True,
        overwrite: bool = True,
        storage_options: dict[str, Any] | None = None,
        on_report: ReportCallback | None = None,
        reuse_staging: bool | None = None,
        compression: str | None = None,
    ):
        super().__init__(reuse_staging=reuse_staging)
        self.transform = stream_transform(compression)
        self.storage_options = storage_options
        self.on_report = options.callback("ShardWriter", "on_report", on_report)
        self.last_report: SaveReport | None = None
        self.clock = PhaseClock(SAVE_PHASES)
        self.written: list[WriteResult] = []  # this rank's results of the running save
        self.location = Location(path, storage_options)
        self.thread_count = io_thread_count(thread_count, "ShardWriter")
        self.sync_files = options.flag("ShardWriter", "sync_files", sync_files)
        self.checksums = options.flag("ShardWriter", "checksums", checksums)
        self.overwrite = options.flag("ShardWriter", "overwrite", overwrite)
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = False
        self.slot = SaveSlot()  # one save at a time, in call order, whichever stager staged it
        self.save_number = 0  # the running save's turn (``SaveSlot``)
        self._created_dir = False  # coordinator: this save created the directory
        self._token = ""  # coordinator: the running save's data-file token
        self._pending_syncs: PendingSyncs | None = None  # coordinator: its data files' fsyncs (write_data)

    # -- DCP protocol ---------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._begin_save(set_up=False)
        if checkpoint_id:
            self.location = Location(checkpoint_id, self.storage_options)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._begin_save(set_up=True)
        if thread_in_save(threading.get_ident()):  # where it writes is known from here on
            DIRECTORY_SAVES.enter(self.location)
        self.clock = PhaseClock(SAVE_PHASES)  # a save starts here on every rank
        self.written = []
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        if not kwargs.get("use_collectives", True):
            raise CheckpointError(
                f"{self.location.url}: ShardWriter commits one checkpoint for the whole job and "
                "needs use_collectives=True"
            )
        if is_coordinator:
            OPEN_SAVES.discard_failed()  # before this save needs the space they hold

    def storage_meta(self) -> StorageMeta | None:
        if thread_in_save(threading.get_ident()):  # without a checkpoint_id DCP's first call of a save
            self._begin_save(set_up=False)
        return self._storage_meta()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.is_coordinator:  # only it, before any rank writes: it alone knows it created the directory
            self._created_dir = self.location.makedirs()
            # tracked from here: a planner's global step that raises never reaches prepare_global_plan,
            # and the directory this save created must still go with the failed save
            self._token = uuid.uuid4().hex[:12]
            OPEN_SAVES.track(OpenSave(self.location, self._token, self.save_id, self._created_dir))
        if not self.overwrite:
            self._refuse_a_held_checkpoint()
        return dataclasses.replace(plan, storage_data=SaveOrder(self.save_number, self.location.url))

    def _refuse_a_held_checkpoint(self) -> None:
        """``overwrite=False``: refuse a directory holding a checkpoint. ``.metadata`` on every
        rank, as stock looks; the other formats we read (ours beside one would hide it from
        every reader of our format) on the coordinator alone, which lists the directory.
        What detection refuses to call a checkpoint (a Megatron save interrupted before its
        ``.metadata``) is none to overwrite."""
        if self.location.exists(METADATA_NAME):
            raise CheckpointExistsError(
                f"{self.location.url}: Checkpoint already exists ({METADATA_NAME} is there) and overwrite=False"
            )
        if not self.is_coordinator:
            return
        try:
            held = held_format(self.location)
        except CheckpointError:
            return
        if held is not None:
            raise CheckpointExistsError(f"{self.location.url}: holds a {held} checkpoint and overwrite=False")

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        check_same_save(plans)
        wait_for_cleanup(self.location)  # the space of the last save's retired files (cleanup)
        remove_dead_files(self.location)  # no rank writes before the plans go out
        return [
            dataclasses.replace(p, storage_data=FilePrefix(rank, self._token, self._created_dir))
            for rank, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.clock.charge_rest("plan")
        if getattr(planner, "_enable_plan_caching", False) is True:  # before anything is written or removed
            _forget_cached_plans(planner)
            if self.is_coordinator:  # nothing is written yet: only the directory this save made, if it did
                OpenSave(self.location, self._token, "", self._created_dir).discard()
            raise InvalidRequestError(
                f"{self.location.url}: DefaultSavePlanner(enable_plan_caching=True) hands later saves the first "
                "save's finished plans, with the data-file names ShardWriter gives that save alone: a later save "
                "would overwrite the live checkpoint's files in place. Use ShardSavePlanner (cache_plans=True "
                "keeps fresh names) or enable_plan_caching=False"
            )
        prefix: FilePrefix = plan.storage_data
        self._data_durable(failed_save=True)  # a save whose finish DCP skipped (another rank failed)
        try:
            self._refuse_quantized(plan)
            with self.clock.phase("write"):
                self.written = self._write_files(plan, planner)
        except BaseException:
            # the save cannot commit now: remove its files, other ranks' too where this rank
            # sees them (a shared directory); the coordinator removes later ones next time
            OpenSave(self.location, prefix.token, "", prefix.created_dir).discard()
            raise
        if not self.is_coordinator:  # its part ends here; the coordinator's after the commit
            self._publish(metadata_bytes=0)
        done: Future[list[WriteResult]] = Future()
        # the results go to the coordinator in DCP's gather: as columns (write_results)
        done.set_result(WrittenItems(with_piece_digests(self.written, self.rank, getattr(planner, "piece_digests", ()))))
        return done

    def _refuse_quantized(self, plan: SavePlan) -> None:
        """Quantized tensors are refused before this rank writes: their records and scales
        are no plain dtype our index records (the checkpoint would commit, then fail every
        load, ours and ``dcp-ext``'s, as corrupt)."""
        for item in plan.items:
            dtype = item.tensor_data.properties.dtype if item.tensor_data is not None else None
            if dtype in QUANTIZED_DTYPES:
                raise InvalidRequestError(
                    f"{self.location.url}: key {item.index.fqn!r} is a quantized tensor ({dtype}), which ShardWriter "
                    "does not store; save tensor.dequantize() (or its int_repr() and scales), or save it with "
                    "FileSystemWriter"
                )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        crash_point("after-data")
        token = self._token
        with discard_on_failure(token):  # until the commit point
            try:
                results, pieces = split_piece_digests(results)
                check_piece_digests(pieces, self.location.url)
                with self.clock.phase("metadata"):  # while this rank's data files are made durable
                    metadata_bytes, index_bytes, referenced = self._encode(metadata, results)
                with self.clock.phase("commit"):  # its temporary files too, then the wait for them
                    commit(self.location, self.save_id, metadata_bytes, index_bytes, referenced, self.sync_files,
                           at_commit_point=lambda: OPEN_SAVES.committed(token), data_durable=self._data_durable)
                    retire(self.location, unreferenced(self.location, referenced))  # their space comes back on a thread
            except BaseException:
                self._data_durable(failed_save=True)  # its threads end before its files are removed
                raise
        self._publish(metadata_bytes=len(metadata_bytes) + len(index_bytes))

    # -- AsyncStager protocol ---------------------------------------------------------------
    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """Copy ``state_dict`` to CPU; complete when this returns. Called by ``dcp.async_save``
        on the caller's thread: the save takes its turn here, in call order (``SaveSlot``),
        where its upload thread, started next, may reach the writer after a later call's."""
        if not uploads_on_a_thread():  # the process executor's upload runs on a copy of the writer
            return super().stage(state_dict)
        target = async_save_target()
        location = self.location if target is None else Location(target, self.storage_options)
        staged = super().stage(state_dict)
        DIRECTORY_SAVES.reserve(location, self.slot.issue(staged))  # a plain save called next runs after it
        return staged

    def close(self) -> None:
        """Wait for the save in flight, free the staging memory and remove the files of saves
        that failed since the last save began (DCP has no failure hook; see ``save_tracking``);
        return once the space of the files the last commit retired is given back (``cleanup``).

        Raises an unreported background failure, as the next save would.
        """
        try:
            super().close()
        finally:
            self.slot.wait_idle()
            self._data_durable(failed_save=True)
            OPEN_SAVES.discard_failed()
            wait_for_cleanup(self.location)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- helpers -------------------------------------------------------------------------
    def _begin_save(self, set_up: bool) -> None:
        """Where a save begins on its thread: report a failed async save, wait for its turn,
        then take a new save id (the commit marker's, never reused)."""
        with DIRECTORY_SAVES.starting():  # the thread's earlier saves are over, whatever it waits for here
            self.finish_async_save_first()
            self.check_staged_here()
            number = self.slot.enter(set_up)
        if number is not None:  # None: a later begin call of the same save
            self.save_number = number
            self.save_id = uuid.uuid4().hex

    def _storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.location.url, save_id=self.save_id)

    def _write_files(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Write this rank's items into up to ``thread_count`` files in parallel."""
        prefix: FilePrefix = plan.storage_data
        for item in plan.items:  # the index stores keys as UTF-8: refused before a byte is written
            try:
                item.index.fqn.encode()
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    f"{self.location.url}: key {item.index.fqn!r} is not valid Unicode text (a lone surrogate, as "
                    "os.fsdecode makes of bytes that are not UTF-8); the checkpoint index stores keys as UTF-8: rename it"
                ) from None
        crash_point("before-data")
        self.location.makedirs()  # the coordinator made it; a rank on its own disk needs it too
        buckets = split_by_bytes(plan.items, self.thread_count)
        results: list[WriteResult] = []
        copies = HostCopies()  # device tensors' bytes through bounded host buffers (made on first use)
        # the coordinator's fsyncs run on while it gathers and encodes (writeback.PendingSyncs)
        defer_sync = self.is_coordinator and self.sync_files and syncs_later(self.location)
        names = [prefix.file_name(n) for n in range(len(buckets))]
        calls = [
            functools.partial(self._write_file, name, bucket, planner, copies, self.sync_files and not defer_sync)
            for name, bucket in zip(names, buckets)
        ]
        for written in run_parallel(calls, "dcp_ext-write"):
            results.extend(written)
        if defer_sync:
            self._pending_syncs = PendingSyncs(self.location, names)
        return results

    def _data_durable(self, failed_save: bool = False) -> None:
        """Wait for the fsyncs of the coordinator's data files (``PendingSyncs``); those of a
        failed save (its ``finish`` raised, or DCP skipped it) without their errors."""
        pending, self._pending_syncs = self._pending_syncs, None
        if pending is None:
            return
        try:
            pending.wait()
        except Exception:
            if not failed_save:
                raise

    @gc_paused()  # a million-chunk save builds and pickles millions of objects, no garbage
    def _encode(self, metadata: Metadata, results: list[list[WriteResult]]) -> tuple[bytes, bytes, set[str]]:
        """The ``.metadata`` and index bytes of the save, and every data file they reference."""
        stored: dict[MetadataIndex, StoredItem] = {}
        copies: dict[MetadataIndex, list[StoredItem]] = {}  # TP-replica copies: index only
        for rank_results in results:
            for wr in rank_results:
                if isinstance(wr.index, ReplicaCopyIndex):
                    copies.setdefault(wr.index.canonical, []).append(wr.storage_data)
                else:
                    stored[wr.index] = wr.storage_data
        metadata.version = DCP_METADATA_VERSION
        metadata.storage_data = {index: item.storage_info() for index, item in stored.items()}
        metadata.storage_meta = self._storage_meta()
        if isinstance(metadata, MetadataOnDemand):
            metadata_bytes = metadata.dumps()
            metadata.broadcast_as(metadata_bytes)  # what DCP broadcasts next: these bytes again
        else:
            metadata_bytes = pickle.dumps(metadata)
        crc = crc32c.crc32c(metadata_bytes)
        index_bytes = encode_index(metadata, stored, metadata_bytes, crc, copies)
        referenced = {item.relative_path for item in stored.values()}
        referenced.update(item.relative_path for items in copies.values() for item in items)
        return metadata_bytes, index_bytes, referenced

    def _publish(self, metadata_bytes: int) -> None:
        """Report this rank's save: its data files are written (and, on the coordinator, committed)."""
        self.last_report = SaveReport(
            checkpoint=self.location.url,
            rank=self.rank,
            is_coordinator=self.is_coordinator,
            seconds=self.clock.totals(),
            bytes_written=sum(result.size_in_bytes for result in self.written),  # records fill the files
            files_written=len({result.storage_data.relative_path for result in self.written}),
            items_written=len(self.written),
            metadata_bytes=metadata_bytes,
        )
        publish(self.last_report, self.on_report)

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, copies: HostCopies, sync: bool
    ) -> list[WriteResult]:
        results = []
        with self.location.create(name, sync, needed=sum(map(item_nbytes, items))) as out:
            # a local file to be fsynced goes to disk while later records are serialized
            writeback = early_writeback(out) if self.sync_files and self.location.is_local else None
            sink = RecordSink(out if writeback is None else writeback, self.checksums)
            for n, item in enumerate(items):
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    stored = write_bytes(sink, name, data, self.transform)
                else:
                    where = f"{self.location.url}/{name} key {item.index.fqn!r}"
                    stored = write_tensor(sink, name, data, where, self.transform, copies.copy_out)
                results.append(WriteResult(index=item.index, size_in_bytes=stored.length, storage_data=stored))
                if n == 0:  # the file holds its first record (an environment lookup a record added ~1 us)
                    crash_point("mid-file")
            sink.drain()
        crash_point("after-file")
        return results


_PLAN_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata", "_cached_final_save_plan")


def _forget_cached_plans(planner: SavePlanner) -> None:
    """Drop what a refused ``DefaultSavePlanner(enable_plan_caching=True)`` save left in DCP's
    plan cache, which is per process and keyed by planner class: plans naming our data files
    would be handed to the next caching save of that class, a stock ``FileSystemWriter``'s
    too (which then failed on every save). Without the entries that save plans afresh."""
    key = getattr(planner, "_cached_plans_key", None)
    for name in _PLAN_CACHES:
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.pop(key, None)
