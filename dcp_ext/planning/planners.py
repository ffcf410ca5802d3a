"""ShardSavePlanner / ShardLoadPlanner: DCP's default planners with our improvements."""

from __future__ import annotations

import dataclasses
import inspect
import io
import math
import numbers
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from dcp_ext.errors import InvalidRequestError
from dcp_ext.formats.index import IndexedKeys
from dcp_ext.formats.replica_copy import ReplicaCopyIndex
from dcp_ext.formats.safe_load import decode_bytes_item
from dcp_ext.planning.dedup import Cuts, chunk_view, refine_items
from dcp_ext.planning.digest_exchange import Agreement, agree, exchange_group, first_senders
from dcp_ext.planning.global_plan import GlobalPlan, RankAssignment, check_replicas, plan_globally
from dcp_ext.planning.load_plan import landing_tensor, local_reads, metadata_read_items
from dcp_ext.planning.local_plan import ShardLocalPlan, TableItems, assigned_items
from dcp_ext.planning.local_shards import ChunkMemo, local_write_items
from dcp_ext.planning.locality import tp_coordinate
from dcp_ext.planning.placement_planning import PlacementLoadMixin, PlacementSaveMixin
from dcp_ext.planning.plan_cache import (
    cached_plan,
    held_tables,
    plan_id,
    plan_key,
    remember_plan,
    remember_units,
    remembered_units,
)
from dcp_ext.planning.plan_table import PlanTable, table_from_items
from dcp_ext.planning.replica_check import alone_marks, chunk_digest, chunk_digest_rows, held_alone
from dcp_ext.planning.replica_units import ReplicaUnits, check_units, unit_hashes, with_units
from dcp_ext.runtime import options
from dcp_ext.runtime.gc_pause import gc_paused
from dcp_ext.storage.piece_digests import PieceDigest
from dcp_ext.storage.read_columns import TensorReads
from dcp_ext.storage.reader import ReaderMode
from dcp_ext.storage.save_tracking import SaveOrder, check_same_save


def _stock_options(owner: str, stock: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords with the ``stock`` planner's positional arguments named, and its flags
    checked: passed by position they went past the checks, and DCP takes any value for a
    flag (``allow_partial_load="false"`` turned partial loads on)."""
    parameters = list(inspect.signature(stock.__init__).parameters.values())[1:]  # after self
    if len(args) > len(parameters):
        raise InvalidRequestError(
            f"{owner} takes at most {len(parameters)} positional arguments ({', '.join(p.name for p in parameters)})"
        )
    given = {p.name: value for p, value in zip(parameters, args)}
    twice = sorted(set(given) & set(kwargs))
    if twice:
        raise InvalidRequestError(f"{owner}: {', '.join(twice)} given by position and by name")
    named = {**given, **kwargs}
    for p in parameters:
        if p.name in named and (isinstance(p.default, bool) or "bool" in str(p.annotation)):
            options.flag(owner, p.name, named[p.name], optional=p.default is None)
    return named


class ShardSavePlanner(PlacementSaveMixin, DefaultSavePlanner):
    """DefaultSavePlanner's local plans, planned globally as columns (``global_plan``):
    replicated items balanced by bytes across their holders, partially overlapping chunks
    (nonuniform TP) refined so each element is saved once, ranks with identical plans planned
    once. ``placement_fn``/``mesh``/``check_replicas``: see PlacementSaveMixin.

    ``replica_locality=True``: tensors replicated across the tensor-parallel mesh dim
    ``tp_dim`` (default ``"tp"``) are also written once per TP rank, into that rank's own
    file, so each rank later loads them from its own file (``dcp_ext.planning.locality``).
    A state dict with no DTensor on a mesh with that dim name is an error, as is
    ``tp_dim`` without ``replica_locality``: neither could take effect. Locality needs the
    replica check: copies that may differ would load per reader.

    ``cache_plans=True``: the coordinator reuses the global plan of an earlier save whose
    every local plan was identical (``dcp_ext.planning.plan_cache``); DCP's
    ``enable_plan_caching`` is accepted as the same switch. Given ``group`` (the process
    group passed to ``dcp.save``; ``dist.group.WORLD`` for the default one), ranks first
    agree on their tables' digests in a small collective on it, so only tables the
    coordinator does not hold travel in DCP's gather, and a reused plan's replica check
    takes one hash per class of shared chunks (``digest_exchange``, ``replica_units``).
    The exchange is opt-in because a planner cannot tell a ``no_dist=True`` save on one
    rank from a distributed save: a collective there would wait forever.

    After a save, the coordinator's ``last_global_plan`` holds the plan with per-phase
    seconds and counts, and ``plan_reused`` says whether it came from the cache.
    """

    def __init__(
        self,
        *args: Any,
        replica_locality: bool = False,
        tp_dim: str | None = None,
        cache_plans: bool = True,
        group: dist.ProcessGroup | None = None,  # the digest exchange's group; None: no exchange
        **kwargs: Any,
    ) -> None:
        options.flag("ShardSavePlanner", "replica_locality", replica_locality)
        options.flag("ShardSavePlanner", "cache_plans", cache_plans)
        if tp_dim is not None and not (isinstance(tp_dim, str) and tp_dim):
            raise InvalidRequestError(f"ShardSavePlanner(tp_dim=...) must be a mesh dimension name or None, got {tp_dim!r}")
        if tp_dim is not None and not replica_locality:
            raise InvalidRequestError("ShardSavePlanner: tp_dim only applies with replica_locality=True")
        # DefaultSavePlanner's own options by name, however they were passed
        kwargs = _stock_options("ShardSavePlanner", DefaultSavePlanner, args, kwargs)
        args = ()
        alias = kwargs.pop("enable_plan_caching", None)  # DCP's name for the same switch
        if alias is not None and options.flag("ShardSavePlanner", "enable_plan_caching", alias) != cache_plans:
            raise InvalidRequestError(
                f"ShardSavePlanner: enable_plan_caching={alias} and cache_plans={cache_plans} (default True) are the same "
                "switch; pass cache_plans alone"
            )
        if kwargs.get("dedup_save_to_lowest_rank"):
            raise InvalidRequestError(
                f"ShardSavePlanner(dedup_save_to_lowest_rank={kwargs['dedup_save_to_lowest_rank']!r}): this planner "
                "spreads replicated items over the ranks that hold them (by bytes), so it cannot take effect; use "
                "DefaultSavePlanner for that policy"
            )
        if group is not None and not cache_plans:
            raise InvalidRequestError("ShardSavePlanner: group= only applies with cache_plans=True (it runs the digest exchange)")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise InvalidRequestError(f"ShardSavePlanner(group=...) must be a torch.distributed ProcessGroup or None, got {group!r}")
        super().__init__(*args, **kwargs)
        if replica_locality and not self.check_replicas:
            raise InvalidRequestError(
                "ShardSavePlanner(replica_locality=True, check_replicas=False): locality stores a TP-replicated tensor "
                "once per TP rank and each rank loads its own copy back, while other readers and layouts load one "
                "copy for all; unchecked copies may differ (check_replicas=False is for ranks that hold different "
                "values under one key), and a rank's value would depend on the reader. Keep check_replicas=True, "
                "or leave replica_locality off"
            )
        self.replica_locality = replica_locality
        self.tp_dim = tp_dim or "tp"
        self.cache_plans = cache_plans
        self.group = group
        self._agreement: Agreement | None = None
        self.last_global_plan: GlobalPlan | None = None
        self.plan_reused = False
        self.piece_digests: tuple[PieceDigest, ...] = ()  # split pieces this rank holds (finish_plan)
        self._local_items: list[WriteItem] = []
        self._chunks: ChunkMemo = {}

    def __getstate__(self) -> dict[str, Any]:
        """DCP pickles the planner into its checkpoint process (``AsyncCheckpointerType.PROCESS``),
        where the training process's group does not exist."""
        if self.group is not None:
            raise InvalidRequestError(
                "ShardSavePlanner(group=...) cannot go to DCP's checkpoint process (AsyncCheckpointerType.PROCESS): "
                "a process group belongs to the process that made it; save with the THREAD executor, or without group="
            )
        return self.__dict__.copy()

    @gc_paused()  # items, indices, chunks and properties per key, and the table: no garbage
    def create_local_plan(self) -> SavePlan:
        group = exchange_group(self.group) if self.group is not None else False
        # a process alone in its job holds no chunk another rank also declares: no digests
        # (1,180 chunks: 19 ms of a 1.07 GB save's planning). The whole job, not group=:
        # a save on more ranks than the planner's group must still be checked
        alone = exchange_group(None) is False
        try:
            self._chunks = {}  # per save: DTensor layouts, for the items and resolve_data
            items = local_write_items(self.state_dict, self._chunks)  # DCP's WriteItems for this rank
            table = table_from_items(items, self.mappings if self.flatten_state_dict else None)
            tp_rank = tp_coordinate(self.state_dict, self.tp_dim) if self.replica_locality else None
        except BaseException:
            if group is not False:  # take part in the exchange so no rank waits, then fail
                agree(group, None, None, self.is_coordinator, self._decide)
            raise
        self._local_items = items
        self._agreement = None if group is False else agree(group, table.digest, tp_rank, self.is_coordinator, self._decide)
        send_table = self._agreement is None or self._agreement.send_table
        units = digests = None
        if self.check_replicas and not alone:
            if self._agreement is not None and self._agreement.plan_id is not None:
                units = remembered_units(self._agreement.plan_id)
            digests = self._chunk_digests(items, units)
        return ShardLocalPlan(
            items=TableItems(),
            table=table if send_table else None,
            table_digest=table.digest,
            chunk_digests=digests if units is None else None,
            unit_hashes=None if units is None else unit_hashes(digests, units),
            tp_rank=tp_rank,
        )

    def _chunk_digests(self, items: list[WriteItem], units: ReplicaUnits | None) -> np.ndarray:
        rows, marked = self._rows_to_digest(items, units)
        digests = chunk_digest_rows(items, self.lookup_object, rows)
        digests[marked] = alone_marks(marked, dist.get_rank())
        return digests

    def _rows_to_digest(self, items: list[WriteItem], units: ReplicaUnits | None) -> tuple[list[int], list[int]]:
        """(rows to digest, rows to mark): digests only where another rank may declare the
        chunk too. Under a reused plan, the rows its units name (the check compares no
        other). Else every row but the non-empty chunks of DTensors sharded over the whole
        job, which get this rank's mark (``alone_marks``): none to digest in pure FSDP (590
        chunks took 9 ms per rank and save), and a refusal where ranks disagree after all."""
        if units is not None:
            return units.rows.tolist(), []
        world = dist.get_world_size()
        mesh_sizes: dict[int, int] = {}
        alone = {fqn for fqn, obj in self.state_dict.items() if held_alone(obj, world, mesh_sizes)}
        marked = [
            row for row, item in enumerate(items)
            if item.index.fqn in alone and math.prod(item.tensor_data.chunk.sizes) > 0  # type: ignore[union-attr]
        ]
        skip = set(marked)
        return [row for row in range(len(items)) if row not in skip], marked

    def _decide(self, digests: list[bytes], tp_ranks: list[int | None]) -> tuple[bytes | None, np.ndarray]:
        """Coordinator, in the digest exchange: the cached plan's id for this layout, and who sends a table."""
        key = plan_key(digests, tp_ranks if self.replica_locality else None)
        cached = plan_id(key) if cached_plan(key) is not None else None
        return cached, first_senders(digests, held_tables())

    @gc_paused()  # the metadata's objects (chunk lists of every key) on a first plan
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # ShardWriter's own check, before the replica check: ranks that paired different saves
        # declare the same chunks with other data, which that check reported as replicas that differ
        check_same_save(all_plans)
        if self.replica_locality and not all(isinstance(plan.storage_data, SaveOrder) for plan in all_plans):
            raise InvalidRequestError(
                "ShardSavePlanner(replica_locality=True) needs ShardWriter, which files the TP-replica copies in "
                "its index; another storage writer would record them in .metadata, where stock readers cannot "
                "read them. Save with ShardWriter, or leave replica_locality off"
            )
        plans = [_shard_plan(plan, rank) for rank, plan in enumerate(all_plans)]
        _refuse_differing_options(plans)
        if self._agreement is not None and self._agreement.world != len(plans):
            raise InvalidRequestError(
                f"ShardSavePlanner: the digest exchange ran on {self._agreement.world} ranks but dcp.save gathered "
                f"{len(plans)} plans: pass ShardSavePlanner(group=...) the process group given to dcp.save"
            )
        tp_ranks = [plan.tp_rank for plan in plans] if self.replica_locality else None
        key = plan_key([plan.table_digest for plan in plans], tp_ranks)
        result = cached_plan(key) if self.cache_plans else None
        self.plan_reused = result is not None
        if result is None:
            digests = [plan.chunk_digests for plan in plans] if self.check_replicas else None
            tables = _resolve_tables(plans)
            result = plan_globally(tables, chunk_digests=digests, tp_ranks=tp_ranks, mesh=self._placements.mesh)
            if self.cache_plans:
                result = with_units(result, plan_id(key)) if self.check_replicas else result
                remember_plan(key, result)
        elif self.check_replicas:
            self._check_cached(result, plans)
        self.last_global_plan = result
        # the storage writer's data of each local plan goes back to it, as DefaultSavePlanner keeps it
        self.global_plan = [
            SavePlan(items=[], planner_data=a, storage_data=plan.storage_data) for a, plan in zip(result.assignments, plans)
        ]
        self.metadata = dataclasses.replace(result.metadata)  # the writer fills in storage data
        return self.global_plan, self.metadata

    def _check_cached(self, result: GlobalPlan, plans: list[ShardLocalPlan]) -> None:
        """The replica check against a reused plan: by unit hashes, or in full when every rank sent its rows."""
        mesh = self._placements.mesh
        if all(plan.unit_hashes is None for plan in plans):
            check_replicas(result.structure, [plan.chunk_digests for plan in plans], mesh)
            return
        hashes = []
        for rank, (plan, assignment) in enumerate(zip(plans, result.assignments)):
            units = assignment.units
            sent = plan.unit_hashes if plan.unit_hashes is not None else unit_hashes(_rows_of(plan, rank), units)
            if len(sent) != len(units.classes):
                raise InvalidRequestError(
                    f"ShardSavePlanner: rank {rank} sent {len(sent)} replica hashes for a plan whose check has "
                    f"{len(units.classes)} for it; its planner cache is out of step (clear_plan_cache() on every rank)"
                )
            hashes.append(sent)
        check_units(result, hashes, mesh)

    @gc_paused()  # the rank's assigned items
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        assignment = new_plan.planner_data
        if not isinstance(assignment, RankAssignment):
            raise InvalidRequestError(
                "ShardSavePlanner: the plan this rank received carries no assignment in planner_data "
                f"(found {type(assignment).__name__}); the storage writer's prepare_global_plan must keep "
                "each plan's planner_data, e.g. dataclasses.replace(plan, storage_data=...)"
            )
        if assignment.units is not None:
            remember_units(assignment.units)
        self.plan = SavePlan(assigned_items(self._local_items, assignment), storage_data=new_plan.storage_data)
        self.piece_digests = self._piece_digests(assignment.cuts) if assignment.cuts and self.check_replicas else ()
        return self.plan

    def _piece_digests(self, cuts: Cuts) -> tuple[PieceDigest, ...]:
        """Digests of every split piece this rank holds, written by it or not: ShardWriter
        sends them with its results and the coordinator compares them before the commit
        (``dcp_ext.storage.piece_digests``; the plan-time check sees declared chunks only)."""
        pieces = [item for item in refine_items(self._local_items, cuts)
                  if item.index.fqn in cuts and item.type == WriteItemType.SHARD]
        return tuple(
            (item.index.fqn, tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes),
             chunk_digest(chunk_view(self.state_dict[item.index.fqn], item, self._chunks, self.lookup_object)))
            for item in pieces
        )

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """DCP's ``lookup_object`` then ``transform_object``, a subclass's overrides
        included (DCP's documented extension points: a subclass that casts or replaces
        what it saves), for a DTensor shard too: its data is found by the whole local
        chunk's index and narrowed to the planned piece where refinement split it."""
        if isinstance(write_item.index, ReplicaCopyIndex):  # a TP-replica copy: the same data as the canonical item
            write_item = dataclasses.replace(write_item, index=write_item.index.canonical)
        if write_item.type == WriteItemType.SHARD:  # possibly a refined sub-chunk
            data = chunk_view(self.state_dict[write_item.index.fqn], write_item, self._chunks, self.lookup_object)
            return self.transform_object(write_item, data)
        return super().resolve_data(write_item)


def _refuse_differing_options(plans: list[ShardLocalPlan]) -> None:
    """Options every rank must pass alike, as each rank's plan shows them: a rank that checks
    replicas sends digests or hashes (a check the others skip compared nothing), one with
    replica_locality its TP rank (its copies were silently not kept, or the plan failed)."""
    for option, shown in (
        ("check_replicas", [plan.chunk_digests is not None or plan.unit_hashes is not None for plan in plans]),
        ("replica_locality", [plan.tp_rank is not None for plan in plans]),
    ):
        if any(shown) != all(shown):
            on = [rank for rank, value in enumerate(shown) if value]
            off = [rank for rank, value in enumerate(shown) if not value]
            raise InvalidRequestError(
                f"ShardSavePlanner({option}=...) differs across ranks: ranks {on} pass {option}=True, ranks {off} "
                "False; pass the same planner options on every rank"
            )


def _shard_plan(plan: SavePlan, rank: int) -> ShardLocalPlan:
    if not isinstance(plan, ShardLocalPlan) or not plan.table_digest:
        raise InvalidRequestError(
            f"ShardSavePlanner: rank {rank}'s local plan is a {type(plan).__name__} without a table digest; "
            "every rank must save with ShardSavePlanner, and the storage writer's prepare_local_plan must keep "
            "the plan's fields (dataclasses.replace(plan, storage_data=...))"
        )
    if type(plan.items) is not TableItems or plan.items:
        raise InvalidRequestError(
            f"ShardSavePlanner: rank {rank}'s local plan came back with items of its own (a subclass's "
            "create_local_plan that changed them?); this planner saves from a table of the whole state dict, so "
            "items left out would still be saved: leave keys out of the state dict instead, or subclass DCP's "
            "DefaultSavePlanner"
        )
    return plan


def _resolve_tables(plans: list[ShardLocalPlan]) -> list[PlanTable]:
    """Each rank's table: sent with its plan, by another rank with the same digest, or held."""
    sent = {plan.table.digest: plan.table for plan in plans if plan.table is not None}
    held = held_tables()
    tables = []
    for rank, plan in enumerate(plans):
        table = sent.get(plan.table_digest)
        if table is None:  # not ``or``: a rank with nothing to save has an empty table, falsy by its length
            table = held.get(plan.table_digest)
        if table is None:
            raise InvalidRequestError(
                f"ShardSavePlanner: rank {rank} sent only its table digest {plan.table_digest.hex()}, which no "
                "rank sent and the coordinator does not hold; the digest exchange and dcp.save ran on different "
                "process groups? (pass ShardSavePlanner(group=...))"
            )
        tables.append(table)
    return tables


def _rows_of(plan: ShardLocalPlan, rank: int) -> np.ndarray:
    if plan.chunk_digests is None:
        raise InvalidRequestError(f"ShardSavePlanner: rank {rank} sent neither chunk digests nor replica hashes")
    return plan.chunk_digests


_PER_ITEM_HOOKS = ("resolve_tensor", "lookup_tensor", "transform_tensor", "commit_tensor", "finish_plan")  # what columns skip


class ShardLoadPlanner(PlacementLoadMixin, DefaultLoadPlanner):
    """DefaultLoadPlanner that never runs code from a checkpoint's non-tensor items.

    DCP's ``load_bytes`` decodes them with ``torch.load(weights_only=False)``: a hostile
    checkpoint runs arbitrary code there. We use ``weights_only=True`` with a small
    allowlist (``dcp_ext.formats.safe_load``: containers, numbers, strings, bytes, tensors,
    ``argparse.Namespace``, numpy arrays and scalars, and classes registered with
    ``torch.serialization.add_safe_globals``); ``allow_unsafe_bytes=True`` restores DCP's
    behaviour for checkpoints you trust (and tells ``ShardReader``, which checks bytes
    items itself for any planner, to skip its check). ``placement_fn``/``mesh``: see
    PlacementLoadMixin.

    Read items stay on their rank: DCP's global load step decides nothing for them, yet
    gathering them costs O(ranks x items) pickled objects through the coordinator. The
    local plan sent up is empty and ``finish_plan`` puts the rank's own items back, so the
    gather is one small message per rank. Storage readers see the items in ``read_data``.

    With metadata from our index, the local plan is computed from the index's columns
    (``load_plan``): only the chunks overlapping this rank's shards become pieces, handed
    to ``ShardReader`` as columns (``storage.read_columns``: no ReadItem per piece) unless
    a subclass or the instance has its own ``resolve_tensor``, ``transform_tensor``,
    ``commit_tensor`` or ``finish_plan``; any other reader gets DCP's ReadItems.
    """

    PLANS_EVERY_ELEMENT = True  # its local plan reads all of each destination (ShardReader checks the plan)

    def __init__(self, *args: Any, allow_unsafe_bytes: bool = False, **kwargs: Any) -> None:
        super().__init__(**_stock_options("ShardLoadPlanner", DefaultLoadPlanner, args, kwargs))
        self.allow_unsafe_bytes = options.flag("ShardLoadPlanner", "allow_unsafe_bytes", allow_unsafe_bytes)
        self._local_items: list[ReadItem] | None = []  # None: the plan went up whole (a subclass's)
        self._shared: set[int] | None = None  # per load: see _shared_tensors
        self._reads: TensorReads | None = None  # per load: the tensor pieces (index loads)

    @gc_paused()  # thousands of read items or columns' rows, no garbage (an index load's or a pickled .metadata's)
    def create_local_plan(self) -> LoadPlan:
        self._shared = None
        keys = None if self.metadata is None else self.metadata.state_dict_metadata
        reads = None
        if isinstance(keys, IndexedKeys):  # our index: plan from its columns (load_plan)
            source = getattr(self.metadata.storage_meta, "checkpoint_id", None) or "the checkpoint"
            items, reads = local_reads(self.state_dict, keys, not self.allow_partial_load, str(source))
            plan = LoadPlan(items)
        elif keys is not None and (not self.flatten_state_dict or set(keys) <= set(self.state_dict)):
            # DCP's plan, DTensor chunks from a memo (load_plan); DCP's own where a saved key
            # is missing: its check for a checkpoint of torch < 2.4 may flatten the state dict again
            plan = LoadPlan(metadata_read_items(self.state_dict, self.metadata, not self.allow_partial_load))
        else:
            plan = super().create_local_plan()
        if type(self).create_local_plan is not ShardLoadPlanner.create_local_plan:
            # a subclass's own create_local_plan changes the items (reads less on purpose): it
            # gets them all, and DCP's plan is its result, as with DefaultLoadPlanner
            self._local_items, self._reads = None, None
            return plan if reads is None else LoadPlan(plan.items + reads.read_items())
        self._local_items, self._reads = plan.items, reads
        return dataclasses.replace(plan, items=[])

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        """The rank's own items back in its plan; its tensor pieces as columns in
        ``planner_data`` where the reader takes them (``storage.read_columns``), else as
        DCP's ReadItems after the others."""
        if self._local_items is None:
            return super().finish_plan(new_plan)
        items, reads = self._local_items, self._reads
        if reads is not None and self._hands_columns(new_plan):
            return super().finish_plan(dataclasses.replace(new_plan, items=items, planner_data=reads))
        if reads is not None:
            items = items + reads.read_items()
        return super().finish_plan(dataclasses.replace(new_plan, items=items))

    def _hands_columns(self, plan: LoadPlan) -> bool:
        """Whether the reader took columns for this plan (our reader says so in its
        ``storage_data``) and skipping this planner's per-item hooks changes nothing: none
        is a subclass's or an instance's own (``transform_tensor`` narrows, ``commit_tensor``
        does nothing: DCP's), and the plan's ``planner_data`` is free."""
        mode = plan.storage_data
        return (
            isinstance(mode, ReaderMode) and mode.takes_columns and plan.planner_data is None
            and all(getattr(type(self), hook) is getattr(ShardLoadPlanner, hook) and hook not in vars(self)
                    for hook in _PER_ITEM_HOOKS)
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """DCP finds a DTensor's local shard by working out its chunk list again for every
        read item (~45 us), and a plain tensor through a chain of protocol checks (~13 us);
        here a DTensor's shard is its local tensor, a plain tensor read at offset 0 is
        itself, and either is narrowed as DCP does. Anything else is DCP's (and its errors),
        as is every item where ``lookup_tensor`` is a subclass's or an instance's own.

        The local tensor is what ``to_local()`` returns a view of through an autograd
        function (~3.5 us a call): the bytes land in the same storage either way. One that
        requires grad is detached before it is narrowed: ``DTensor.from_local`` over a tensor
        that requires grad holds a view made in no-grad mode, and narrowing that again once a
        read wrote into it in place raised autograd's "view was created in no_grad mode"."""
        if getattr(self.lookup_tensor, "__func__", None) is not DefaultLoadPlanner.lookup_tensor:
            return super().resolve_tensor(read_item)  # a subclass's or an instance's own lookup decides
        obj = self.state_dict.get(read_item.dest_index.fqn)
        local = landing_tensor(obj)
        if local is None or (type(obj) is torch.Tensor and any(read_item.dest_index.offset or ())):
            return super().resolve_tensor(read_item)
        transform = self.transform_tensor  # a subclass's or an instance's own: called for every item
        if getattr(transform, "__func__", None) is DefaultLoadPlanner.transform_tensor and (
            local.shape == read_item.lengths and not any(read_item.dest_offsets)
        ):
            return local  # what DCP's narrow gives for the whole tensor, without a view per dim (~2 us)
        return transform(read_item, local)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """DCP puts the stored object in place of whatever the state dict holds. Where that
        is a tensor, a stored number (an optimizer's ``lr`` or ``step`` saved as a float,
        loaded into one kept as a tensor) goes into a 0-d tensor of its dtype instead:
        written into the tensor itself, so loads into a model's own tensors take effect,
        unless other keys hold the same tensor (torch.optim shares a tensor default across
        param groups), which then each get a new one. Anything else is refused: DCP would
        swap the tensor for it (a hostile checkpoint: for one of another shape)."""
        fqn = read_item.dest_index.fqn
        if self.allow_unsafe_bytes:
            obj = torch.load(value, weights_only=False)
        else:
            obj = decode_bytes_item(value, f"key {fqn!r}", "ShardLoadPlanner(allow_unsafe_bytes=True)")
        dst = self.state_dict.get(fqn)
        if isinstance(dst, torch.Tensor):
            number = scalar_for(fqn, dst, obj)
            if id(dst) not in self._shared_tensors():
                with torch.no_grad():
                    dst.fill_(number)
                return
            obj = torch.tensor(number, dtype=dst.dtype, device=dst.device)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def _shared_tensors(self) -> set[int]:
        """Ids of tensors the state dict holds under more than one key (once per load)."""
        if self._shared is None:
            seen: set[int] = set()
            self._shared = set()
            for obj in self.state_dict.values():
                if isinstance(obj, torch.Tensor):
                    (self._shared if id(obj) in seen else seen).add(id(obj))
        return self._shared


def scalar_for(fqn: str, dst: torch.Tensor, obj: Any) -> bool | int | float:
    """The stored number ``obj`` as the 0-d tensor ``dst`` holds it; refused when it is no
    number, ``dst`` has dims, or its dtype cannot hold the value (an integer out of range or
    with a fraction, a finite float that overflows): a tensor cast would change it silently."""
    if not isinstance(obj, (numbers.Real, np.bool_)) or dst.dim() != 0:
        raise InvalidRequestError(
            f"key {fqn!r}: the checkpoint stores a non-tensor item ({type(obj).__name__}) where the state dict "
            f"holds a tensor of shape {list(dst.shape)}; only a number loads into a tensor, a 0-d one. Load this "
            "key into a state dict holding a non-tensor value there"
        )
    value = bool(obj) if isinstance(obj, (bool, np.bool_)) else int(obj) if isinstance(obj, numbers.Integral) else float(obj)
    dtype = dst.dtype
    if dtype == torch.bool:
        fits = value in (0, 1)
    elif dtype.is_floating_point:
        fits = not math.isfinite(value) or bool(torch.tensor(value, dtype=torch.float64).to(dtype).float().isfinite())
    elif dtype.is_complex:
        fits = True
    else:
        info = torch.iinfo(dtype)
        fits = math.isfinite(value) and float(value).is_integer() and info.min <= value <= info.max
    if not fits:
        raise InvalidRequestError(
            f"key {fqn!r}: the checkpoint stores the number {value!r}, which the state dict's {dtype} tensor "
            "cannot hold"
        )
    return value
