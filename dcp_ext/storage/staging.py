"""Staging for ``dcp.async_save``: one reusable CPU copy of the state dict per writer.

``dcp.async_save`` uses the storage writer as its stager when the writer implements DCP's
``AsyncStager`` protocol; otherwise it builds a fresh ``DefaultStager`` per call and closes
it afterwards, so every save allocates (and page-faults) a new CPU copy of the whole state
dict. ``AsyncStagingMixin`` makes ``ShardWriter`` its own stager and keeps the copy:

* Reuse. The buffers are keyed on the state dict's structure (every path, and each tensor's
  shape, dtype, stride and device; for a DTensor also its mesh, placements and global
  shape; for a ShardedTensor its shard layout). A save with the same structure copies into
  the same memory; a changed structure drops the old buffers first, then allocates new
  ones, so at most one set is held. Buffers are pinned when a tensor lives on CUDA and CUDA
  is available. Allocation and copy are torch's own (``_create_cpu_state_dict`` /
  ``_copy_state_dict``, as ``BlockingAsyncStager`` uses them), so DTensor and ShardedTensor
  local shards are staged the way DCP stages them; non-tensor values are copied per save.
* Synchronous. ``stage`` returns once every byte is copied: the caller may change its
  tensors as soon as ``dcp.async_save`` returns.
* One save at a time per writer. A save through a writer whose previous save is still
  running waits for it before touching the buffers. A second buffer set would not help:
  with DCP's thread executor both saves would run DCP's collectives on the same process
  group from two threads at once and share the writer's per-save state (path, save id,
  rank); DCP's checkpoint process serves one request at a time anyway, so the second save
  would only queue behind the first while holding twice the memory. The wait costs the
  training step only when saves are started faster than they finish. (The writer itself
  also admits one save at a time, in ``reset``/``set_up_storage_writer``, for saves staged
  by another stager: ``dcp_ext.storage.save_tracking.SaveSlot``.)
* A plain ``dcp.save`` through the writer while its async save runs (same thread) waits
  for that save too, for the same reasons.
* Failures surface. DCP raises a background failure from the future's ``.result()``; the
  next ``async_save`` through the same writer raises it again, once, as a
  ``CheckpointError`` naming the checkpoint (it cannot tell whether ``.result()`` was
  called, and a lost checkpoint must not go unnoticed). A save that fails before its
  commit point leaves the previous checkpoint intact (``dcp_ext.storage.commit``).

DCP never hands a stager the future it returns. ``async_save`` calls
``synchronize_staging()`` right after it scheduled the upload, so the mixin takes that
future (and the ``checkpoint_id`` argument) from the enclosing ``async_save`` call there.
When it cannot (``stage`` called outside ``async_save``, or the upload never scheduled), it
cannot know when the previous staged copy is free, so the next save stages into new memory
(with a warning) instead of reusing it. ``close()`` waits for the save in flight, raises its
failure like the next save would, and releases the buffers; DCP never closes a writer.

With ``AsyncCheckpointerType.PROCESS`` torch moves the staged tensors into shared memory
when it sends them to its checkpoint process, the first time only: from the second save on
the reused buffers already live there.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from dcp_ext.errors import CheckpointError

_ASYNC_SAVE_CODE = inspect.unwrap(state_dict_saver.async_save).__code__

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


class StagingBuffers:
    """CPU copies of a state dict, reused while its structure stays the same.

    Args:
        reuse: keep the buffers between saves (False: new memory per save, like DCP's own
            stager, released when the save lets go of it).
    """

    def __init__(self, reuse: bool = True):
        self.reuse = reuse
        self.allocations = 0  # buffer sets allocated so far
        self._key: tuple[Any, ...] | None = None
        self._buffers: STATE_DICT_TYPE | None = None

    @torch.no_grad()
    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """A CPU copy of ``state_dict``, complete when this returns."""
        structure = Structure.of(state_dict)
        if not self.reuse:
            return _copy_state_dict(state_dict, self._allocate(state_dict, structure), type_check=False)
        if structure.key != self._key:
            self.release()  # before allocating: never two sets at once
            self._buffers = self._allocate(state_dict, structure)
            self._key = structure.key
        return _copy_state_dict(state_dict, self._buffers, type_check=False)

    def release(self) -> None:
        """Drop the buffers (memory is freed once no save holds a staged copy)."""
        self._key = None
        self._buffers = None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held for reuse."""
        return sum(t.nbytes for t in local_tensors(self._buffers or {}))

    def data_ptrs(self) -> list[int]:
        """Where each held buffer's data lives: equal across saves when memory is reused."""
        return [t.data_ptr() for t in local_tensors(self._buffers or {})]

    def _allocate(self, state_dict: STATE_DICT_TYPE, structure: Structure) -> STATE_DICT_TYPE:
        self.allocations += 1
        return _create_cpu_state_dict(state_dict, pin_memory=structure.pin_memory)


@dataclasses.dataclass
class _PendingSave:
    """A save whose staged copy may still be in use: its checkpoint and DCP's future for it."""

    checkpoint: str
    thread: int  # the thread that staged it (DCP runs the upload elsewhere)
    future: concurrent.futures.Future | None = None


def _enclosing_async_save() -> dict[str, Any] | None:
    """The locals of the ``dcp.async_save`` call this code runs inside, or None."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _ASYNC_SAVE_CODE:
        frame = frame.f_back
    return None if frame is None else dict(frame.f_locals)


class AsyncStagingMixin(AsyncStager):
    """Makes a storage writer its own ``AsyncStager`` with reusable staging buffers.

    For ``ShardWriter`` (needs its ``location``). ``reuse_staging=False`` stages every save
    into new memory; saves are still serialized and failures still surface.
    """

    def __init__(self, *args: Any, reuse_staging: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.staging = StagingBuffers(reuse_staging)
        self._pending_save: _PendingSave | None = None

    # -- AsyncStager protocol ---------------------------------------------------------------
    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """Copy ``state_dict`` to CPU once the previous save through this writer is done."""
        if not self._wait_for_previous_save():
            warnings.warn(
                f"{self.location.url}: the previous staged copy may still be in use (no dcp.async_save "
                "future was seen for it); staging into new memory",
                RuntimeWarning,
                stacklevel=2,
            )
            self.staging.release()
        staged = self.staging.stage(state_dict)
        self._pending_save = _PendingSave(self.location.url, threading.get_ident())
        return staged

    def synchronize_staging(self) -> None:
        """Called by ``async_save`` after it scheduled the upload: remember its future.

        Staging itself is already complete when ``stage`` returns.
        """
        pending, call = self._pending_save, _enclosing_async_save()
        if pending is None or pending.future is not None or call is None:
            return
        futures = [v for v in call.values() if isinstance(v, concurrent.futures.Future)]
        if len(futures) == 1:
            pending.future = futures[0]
        if call.get("checkpoint_id") is not None:
            pending.checkpoint = str(call["checkpoint_id"])

    def finish_async_save_first(self) -> None:
        """Called where every save starts (``reset``, ``set_up_storage_writer``): a save started
        on the thread that staged the async save still running (a plain ``dcp.save`` after
        ``dcp.async_save``) waits for it and raises its failure, because the two would share
        this writer's per-save state and run collectives on one process group at once. The
        upload's own calls come from DCP's executor thread (or process) and pass through.
        """
        pending = self._pending_save
        if pending is None or pending.thread != threading.get_ident():
            return
        if pending.future is None:
            warnings.warn(
                f"{self.location.url}: a save started while an async save staged by this writer may still "
                "be running (no dcp.async_save future was seen for it to wait on)",
                RuntimeWarning,
                stacklevel=3,
            )
            return
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
        state = self.__dict__.copy()
        state["staging"] = StagingBuffers(self.staging.reuse)  # buffers stay in this process
        state["_pending_save"] = None  # futures do not pickle; the child never stages
        return state

    # -- helpers -----------------------------------------------------------------------------
    def _wait_for_previous_save(self) -> bool:
        """Wait for the previous save and raise its failure (once). False: its future is unknown."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return True
        if pending.future is None:
            return False
        concurrent.futures.wait([pending.future])
        error = None if pending.future.cancelled() else pending.future.exception()
        if error is not None:
            raise CheckpointError(
                f"{pending.checkpoint}: the previous dcp.async_save through this writer failed in the "
                f"background; the directory holds the last checkpoint that committed: "
                f"{type(error).__name__}: {error}"
            ) from error
        return True
