"""Staging for async saves: one reusable CPU copy of the state dict per writer.

Built on DCP's public staging contract only. ``ShardWriter`` is an ``AsyncStager``
whose ``stage`` blocks until the copy is complete and which, like torch's
``BlockingAsyncStager``, sets ``should_synchronize_after_execute`` to False: DCP never
calls the deprecated ``synchronize_staging`` hook, and ``dcp.async_save`` returns the plain
upload future. Two layers:

* ``StagingBuffers``: structure-keyed reuse. The buffers are keyed on the state dict's
  structure (every path, and each tensor's shape, dtype, stride and device; for a DTensor
  also its mesh, placements and global shape; for a ShardedTensor its shard layout). A save
  with the same structure copies into the same memory; a changed structure drops the old
  buffers first, then allocates new ones, so at most one set is held. Buffers are pinned
  when a tensor lives on CUDA and CUDA is available. Allocation and copy are torch's own
  (``_create_cpu_state_dict`` / ``_copy_state_dict``, as ``BlockingAsyncStager`` uses
  them); without reuse each save is staged by a ``BlockingAsyncStager``.
* ``AsyncStagingMixin``: when a staged copy is free again. DCP gives a stager no handle on
  the upload: the only public signal that a save has finished with its staged copy (and
  whether it failed) is the future ``dcp.async_save`` returns to its caller.
  ``writer.async_save(state_dict, ...)`` calls ``dcp.async_save`` with the writer as
  storage writer and stager, keeps that future and returns it. Its next call waits for
  that future before staging into the same buffers (one save at a time per writer: with
  DCP's thread executor two saves at once would run collectives on one process group from
  two threads and share the writer's per-save state; DCP's checkpoint process serves one
  request at a time anyway), and a failed save is raised once more, as a
  ``CheckpointError`` naming the checkpoint, by the next ``writer.async_save``, by a plain
  ``dcp.save`` through the writer from the same thread, or by ``close()``.

``dcp.async_save(storage_writer=writer)`` called directly never hands the writer its
future, so the writer cannot know when a copy is free: it stages such a save into new
memory that it does not keep (as stock DCP does), and the save's failure is reported by
its future alone. ``reuse_staging=True`` asks for reuse in every save, so there ``stage``
refuses a direct call, naming the option; ``reuse_staging=False`` never reuses.

With ``AsyncCheckpointerType.PROCESS`` torch moves the staged tensors into shared memory
when it sends them to its checkpoint process, the first time only: from the second save on
the reused buffers already live there. The writer is pickled there without its buffers.
"""


from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import os
import pickle
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import DTensor

from dcp_ext.errors import CheckpointError, InvalidRequestError
from dcp_ext.storage.save_tracking import NOT_AN_UPLOAD, OPEN_SAVES, uploaded_state_dict

NodePath = tuple[Any, ...]


def _nodes(obj: Any, path: NodePath = ()) -> Iterator[tuple[NodePath, Any]]:
    """Every container and leaf of a state dict, with its path; containers as DCP walks them."""
    yield path, obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _nodes(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for n, value in enumerate(obj):
            yield from _nodes(value, (*path, n))


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.dtype, t.stride(), t.device


def _node_key(obj: Any) -> tuple[Any, ...]:
    """What of one node the staging buffers depend on (values of non-tensors do not count)."""
    if isinstance(obj, ShardedTensor):
        layout = tuple(
            (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement)) for m in obj.metadata().shards_metadata
        )
        return "sharded", tuple(obj.size()), layout, tuple(_tensor_key(s.tensor) for s in obj.local_shards())
    if isinstance(obj, DTensor):
        local = _tensor_key(obj._local_tensor)
        return "dtensor", obj.device_mesh, obj.placements, tuple(obj.shape), obj.stride(), local
    if isinstance(obj, torch.Tensor):
        return "tensor", *_tensor_key(obj)
    if isinstance(obj, (dict, list, tuple)):
        return (type(obj).__name__,)
    return ("object",)


def local_tensors(state_dict: STATE_DICT_TYPE) -> Iterator[torch.Tensor]:
    """The rank-local tensors that hold a state dict's data."""
    for _, obj in _nodes(state_dict):
        if isinstance(obj, ShardedTensor):
            yield from (shard.tensor for shard in obj.local_shards())
        elif isinstance(obj, DTensor):
            yield obj._local_tensor
        elif isinstance(obj, torch.Tensor):
            yield obj


@dataclasses.dataclass(frozen=True)
class Structure:
    """The staging cache key of a state dict, and whether its buffers should be pinned."""

    key: tuple[Any, ...]
    pin_memory: bool

    @classmethod
    def of(cls, state_dict: STATE_DICT_TYPE) -> Structure:
        key = tuple((path, _node_key(obj)) for path, obj in _nodes(state_dict))
        on_cuda = any(t.device.type == "cuda" for t in local_tensors(state_dict))
        return cls(key, on_cuda and torch.cuda.is_available())


def own_scalar_copies(staged: Any) -> Any:
    """``staged`` with a CPU copy of its own for every 0-d DTensor: torch's staging
    (``_create_cpu_state_dict``) hands such a tensor back itself, so training that changes
    it while the upload runs changed the checkpoint. ``staged``'s containers are the
    staging's own, rebuilt or changed in place here."""
    if isinstance(staged, DTensor) and staged.dim() == 0:
        return copy.deepcopy(staged) if staged.device.type == "cpu" else staged.to("cpu")
    if isinstance(staged, dict):
        for key, value in staged.items():
            staged[key] = own_scalar_copies(value)
    elif isinstance(staged, list):
        staged[:] = [own_scalar_copies(value) for value in staged]
    elif isinstance(staged, tuple):
        return tuple(own_scalar_copies(value) for value in staged)
    return staged


class StagingBuffers:
    """CPU copies of a state dict, reused while its structure stays the same.

    Args:
        reuse: keep the buffers between saves (False: new memory per save from torch's
            ``BlockingAsyncStager``, as stock DCP stages, released when the save lets go of it).
    """

    def __init__(self, reuse: bool = True):
        self.reuse = reuse
        self._fresh = BlockingAsyncStager()  # torch's own, for copies that are not kept
        self.allocations = 0  # buffer sets allocated so far
        self._key: tuple[Any, ...] | None = None
        self._buffers: STATE_DICT_TYPE | None = None

    @torch.no_grad()
    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """A CPU copy of ``state_dict``, complete when this returns."""
        if not self.reuse:
            return self.copy(state_dict)
        structure = Structure.of(state_dict)
        if structure.key != self._key:
            self.release()  # before allocating: never two sets at once
            self.allocations += 1
            self._buffers = own_scalar_copies(_create_cpu_state_dict(state_dict, pin_memory=structure.pin_memory))
            self._key = structure.key
        return _copy_state_dict(state_dict, self._buffers, type_check=False)

    def copy(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """A CPU copy of ``state_dict`` in new memory, held only by the save it is given to."""
        self.allocations += 1
        return own_scalar_copies(self._fresh.stage(state_dict))

    def release(self) -> None:
        """Drop the buffers (memory is freed once no save holds a staged copy)."""
        self._key = None
        self._buffers = None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held for reuse."""
        return sum(t.nbytes for t in local_tensors(self._buffers or {}))

    def holds(self, staged: STATE_DICT_TYPE) -> bool:
        """Whether ``staged`` is a copy this staging made: its first tensor is one of the
        held buffers (a state dict without tensors needs none)."""
        first = next(local_tensors(staged), None)
        return first is None or any(first is t for t in local_tensors(self._buffers or {}))

    def data_ptrs(self) -> list[int]:
        """Where each held buffer's data lives: equal across saves when memory is reused."""
        return [t.data_ptr() for t in local_tensors(self._buffers or {})]


@dataclasses.dataclass
class _PendingSave:
    """A save whose staged copy may still be in use: its checkpoint, the thread that started
    it (DCP runs the upload elsewhere) and the future ``dcp.async_save`` returned for it."""

    checkpoint: str
    thread: int
    future: concurrent.futures.Future


class AsyncStagingMixin(AsyncStager):
    """Makes a storage writer its own ``AsyncStager`` with reusable staging buffers.

    For ``ShardWriter`` (needs its ``location``). ``reuse_staging``: None reuses in saves
    started with ``async_save``; True as well, and refuses ``dcp.async_save`` called
    directly; False stages every save into new memory (saves through ``async_save`` are
    still serialized and their failures still surface).
    """

    # staging is complete when ``stage`` returns: DCP must not call the deprecated
    # ``synchronize_staging`` (``BlockingAsyncStager`` sets the same)
    _synchronize_after_execute: bool = False

    def __init__(self, *args: Any, reuse_staging: bool | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if reuse_staging is not None and not isinstance(reuse_staging, bool):
            raise InvalidRequestError(f"ShardWriter: reuse_staging must be None, True or False, got {reuse_staging!r}")
        self.reuse_staging = reuse_staging
        self.staging = StagingBuffers(reuse_staging is not False)
        self._pending_save: _PendingSave | None = None
        self._starting = threading.Lock()  # one ``async_save`` call at a time
        self._stager_thread: int | None = None  # the thread inside ``async_save``, while it stages

    def async_save(
        self,
        state_dict: STATE_DICT_TYPE,
        *,
        checkpoint_id: str | os.PathLike[str] | None = None,
        planner: SavePlanner | None = None,
        process_group: ProcessGroup | None = None,
        async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
        no_dist: bool = False,
    ) -> concurrent.futures.Future:
        """``dcp.async_save`` through this writer, which stages; returns DCP's upload future.

        Waits for the previous save started here (raising its failure, once) before staging
        into the same buffers; returns once the copy is complete.
        """
        with self._starting:
            self._wait_for_previous_save()
            self._stager_thread = threading.get_ident()
            try:
                future = state_dict_saver.async_save(
                    state_dict,
                    checkpoint_id=checkpoint_id,
                    storage_writer=self,
                    planner=planner,
                    process_group=process_group,
                    async_checkpointer_type=async_checkpointer_type,
                    no_dist=no_dist,
                )
            finally:
                self._stager_thread = None
            if not isinstance(future, concurrent.futures.Future):  # a stager that blocks gets a plain future
                raise CheckpointError(f"{self.location.url}: dcp.async_save returned {type(future).__name__}, not a Future")
            checkpoint = self.location.url if checkpoint_id is None else str(checkpoint_id)
            self._pending_save = _PendingSave(checkpoint, threading.get_ident(), future)
            return future

    # -- AsyncStager protocol ---------------------------------------------------------------
    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """Copy ``state_dict`` to CPU; complete when this returns."""
        if self._stager_thread == threading.get_ident():  # inside ``async_save``: its future will be kept
            return self.staging.stage(state_dict)
        if self.reuse_staging:
            raise InvalidRequestError(
                f"{self.location.url}: ShardWriter(reuse_staging=True) reuses its staging memory only in saves "
                "started with writer.async_save(state_dict, ...), which keeps the future DCP returns to know "
                "when the copy is free (dcp.async_save never hands it to the writer); call writer.async_save "
                "with the same arguments, or leave reuse_staging at None to stage direct calls into new memory"
            )
        return self.staging.copy(state_dict)

    def check_staged_here(self) -> None:
        """``reuse_staging=True``, in the upload of an async save (DCP's executor thread, or
        the thread that hands the save to its checkpoint process): the save must carry this
        writer's staging copy. ``dcp.async_save(async_stager=...)`` staged it with that
        stager, which the writer never sees: reuse could not take effect, and is refused."""
        if self.reuse_staging is not True:
            return
        staged = uploaded_state_dict()
        if staged is not NOT_AN_UPLOAD and not self.staging.holds(staged):
            raise InvalidRequestError(
                f"{self.location.url}: ShardWriter(reuse_staging=True) reuses its staging memory only in saves it "
                "stages itself, but this async save was staged by another stager (dcp.async_save(async_stager=...)); "
                "drop async_stager and call writer.async_save, or leave reuse_staging at None"
            )

    def finish_async_save_first(self) -> None:
        """Called where every save starts (``reset``, ``set_up_storage_writer``): a save started
        on the thread that started the async save still running (a plain ``dcp.save`` after
        ``writer.async_save``) waits for it and raises its failure, because the two would
        share this writer's per-save state and run collectives on one process group at once.
        The upload's own calls come from DCP's executor thread (or process) and pass through.
        """
        pending = self._pending_save
        if pending is not None and pending.thread == threading.get_ident():
            self._wait_for_previous_save()

    def close(self) -> None:
        """Wait for the save in flight, then release the staging memory.

        Raises that save's failure, as the next save would.
        """
        try:
            self._wait_for_previous_save()
        finally:
            self.staging.release()

    # -- process executor: the writer is pickled to DCP's checkpoint process ----------------
    def __getstate__(self) -> dict[str, Any]:
        self.check_staged_here()  # the process executor pickles the writer on its upload thread
        state = self.__dict__.copy()
        state["staging"] = StagingBuffers(self.staging.reuse)  # buffers stay in this process
        state["_pending_save"] = None  # futures do not pickle; the child never stages
        state["_starting"] = None  # locks do not pickle; the child never starts a save
        state["_stager_thread"] = None
        if not _picklable(self.on_report):  # README: the checkpoint process calls a picklable one only
            warnings.warn(
                f"ShardWriter(on_report={self.on_report!r}) cannot be pickled into DCP's checkpoint process "
                "(AsyncCheckpointerType.PROCESS): it is not called for this save; pass a module-level function",
                stacklevel=2,
            )
            state["on_report"] = None
        return state

    # -- helpers -----------------------------------------------------------------------------
    def _wait_for_previous_save(self) -> None:
        """Wait for the previous save started here and raise its failure (once)."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        concurrent.futures.wait([pending.future])
        error = None if pending.future.cancelled() else pending.future.exception()
        if error is not None:
            OPEN_SAVES.discard_failed()  # its files (and the directory it made) go now, as a plain save's do
            raise CheckpointError(
                f"{pending.checkpoint}: the previous async save through this writer failed in the "
                f"background; the directory holds the last checkpoint that committed: "
                f"{type(error).__name__}: {error}"
            ) from error


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # whatever pickling raises (local functions, locks, open files)
        return False
    return True
