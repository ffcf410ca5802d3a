"""Which saves are running, and which ended without a commit.

DCP gives a ``StorageWriter`` no hook when a save fails: ``write_data`` returns, the
coordinator gathers every rank's result and calls ``finish`` only when all succeeded; a
failure anywhere is raised from ``dcp.save`` on every rank without another writer call.
The writer's own view of a save therefore ends in one of two ways: it passes its commit
point, or the thread that ran it leaves ``dcp.save``. This module watches the second.

* ``SaveSlot``: one save at a time through a writer, in call order. With DCP's thread
  executor every ``dcp.async_save`` runs ``dcp.save`` on a new thread, so saves through one
  writer not awaited in between overlap and would clobber its per-save state (directory,
  save id), writing into each other's directories. A save waits where it begins (``reset``,
  ``storage_meta``, ``set_up_storage_writer``), before its first collective, until its turn
  comes and the thread of the previous save left ``dcp.save`` (so that save's collectives,
  the result broadcast included, are all done on this rank). Turns follow the calls: a
  save the writer stages takes its turn in ``stage``, on the caller's thread (``issue``),
  so every rank runs its k-th call as its k-th save and the ranks pair the same saves,
  however their upload threads are scheduled; any other save (a plain ``dcp.save``, one
  staged by another stager) takes its turn when it reaches the writer. Each turn has a
  number among the saves on its process group, which the ranks compare in the plan exchange
  (``ShardWriter``).
* ``DIRECTORY_SAVES``: one save at a time into a directory in this process, whichever
  writer runs it, in call order. A save through a second writer (a new
  ``ShardWriter(path)`` per save) waits where it is set up, before its first collective,
  until the saves called before it into that directory have left ``dcp.save``: an async
  save its writer staged holds its place from the call (its writer's turn, ``reserve``),
  so a plain save called after it runs after it even when it gets to the directory first.
  Its turn among its own writer's saves, and so the number the ranks compare, stays its
  writer's.
* ``OPEN_SAVES``: saves a coordinator planned but has not committed, process-wide. Once
  the thread that ran one has left ``dcp.save`` it failed; the next save (through any
  writer) or ``ShardWriter.close()`` removes its files from its directory, including
  files another rank finished after the failing rank had cleaned up.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import itertools
import logging
import sys
import threading
import time
import types
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_ext.errors import CheckpointError
from dcp_ext.storage.commit import discard_save
from dcp_ext.storage.location import Location

log = logging.getLogger("dcp_ext")

POLL_SECONDS = 0.01
# a save the writer staged whose upload thread has not reached the writer this long after the
# call (its thread could not start, or it failed first) no longer holds later saves back
UNCLAIMED_TURN_SECONDS = 60.0
_SAVE_FUNCTIONS = ("save", "save_state_dict", "_save_state_dict")  # whichever this torch has
_SAVE_CODES = frozenset(
    inspect.unwrap(fn).__code__
    for fn in (getattr(state_dict_saver, name, None) for name in _SAVE_FUNCTIONS)
    if fn is not None
)
_ASYNC_SAVE_CODE = inspect.unwrap(state_dict_saver.async_save).__code__


NOT_AN_UPLOAD = object()


def _upload_codes() -> dict[types.CodeType, str]:
    """DCP's async executors' upload functions (private modules: whichever this torch has),
    each with its local that holds the staged state dict once it is resolved."""
    from torch.distributed.checkpoint import _async_process_executor, _async_thread_executor

    found = {}
    for fn, local in (
        (getattr(_async_thread_executor, "save_wrapper", None), "staged_dict"),
        (getattr(getattr(_async_process_executor, "_ProcessBasedAsyncCheckpointExecutor", None), "_execute_save_impl", None),
         "staged_state_dict"),
    ):
        if fn is not None:
            found[inspect.unwrap(fn).__code__] = local
    return found


_UPLOAD_CODES = _upload_codes()


def uploaded_state_dict() -> object:
    """The staged state dict that DCP's async executor uploads on the calling thread (the
    thread executor's ``dcp.save``, or the process executor handing it to its process), or
    ``NOT_AN_UPLOAD`` when the caller is in no such upload."""
    frame = next(_own_frames(frozenset(_UPLOAD_CODES)), None)
    return NOT_AN_UPLOAD if frame is None else frame.f_locals.get(_UPLOAD_CODES[frame.f_code], NOT_AN_UPLOAD)


def thread_in_save(ident: int | None) -> bool:
    """Whether thread ``ident`` is inside ``dcp.save`` (or the deprecated ``save_state_dict``)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        if frame.f_code in _SAVE_CODES:
            return True
        frame = frame.f_back
    return False


def _own_frames(code: frozenset[types.CodeType]) -> Iterator[types.FrameType]:
    """The calling thread's frames running one of ``code``, innermost first."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in code:
            yield frame
        frame = frame.f_back


def save_group() -> object:
    """Which ranks the caller's save (or async save) runs on: saves through a writer are
    numbered per group, since the ranks outside a sub-group do not count its saves (one
    rank-0 save on its own put every later save's numbers out of step for good)."""
    for frame in _own_frames(_SAVE_CODES | {_ASYNC_SAVE_CODE}):
        if "process_group" not in frame.f_locals:
            continue
        if frame.f_locals.get("no_dist") or not dist.is_initialized():
            return "no_dist"
        return tuple(dist.get_process_group_ranks(frame.f_locals["process_group"] or dist.group.WORLD))
    return None


def uploads_on_a_thread() -> bool:
    """Whether the caller is inside ``dcp.async_save`` with DCP's thread executor: its upload
    then runs ``dcp.save`` on a thread of this process, which will come for a turn."""
    return any(
        frame.f_locals.get("async_checkpointer_type") == AsyncCheckpointerType.THREAD
        for frame in _own_frames(frozenset([_ASYNC_SAVE_CODE]))
    )


def async_save_target() -> object:
    """The ``checkpoint_id`` given to the caller's ``dcp.async_save`` (None: none given, the
    writer's own directory)."""
    frame = next(_own_frames(frozenset([_ASYNC_SAVE_CODE])), None)
    return None if frame is None else frame.f_locals.get("checkpoint_id")


@dataclasses.dataclass(eq=False)
class Turn:
    """One save's place in a writer's order."""

    number: int  # the save's position among the saves on its process group through the writer on this rank
    staged: object = None  # a save the writer staged: its staged state dict, until its thread comes
    thread: threading.Thread | None = None  # the thread running the save, once it came
    set_up: bool = False  # the save passed its last begin call: the thread's next one is a new save
    ended: bool = False  # its thread began a later save: inside dcp.save again, but not in this one
    admitted: bool = False  # its directory let it in (``DirectorySaves``)
    issued: float = dataclasses.field(default_factory=time.monotonic)

    def over(self) -> bool:
        """The save left ``dcp.save`` (or its thread never came and no longer will be waited for)."""
        if self.ended:
            return True
        if self.thread is None:
            return time.monotonic() - self.issued > UNCLAIMED_TURN_SECONDS
        return not (self.thread.is_alive() and thread_in_save(self.thread.ident))


class SaveSlot:
    """Admits one ``dcp.save`` at a time, in turn order; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._numbers: dict[object, itertools.count[int]] = {}  # per process group (``save_group``)
        self._waiting: list[Turn] = []  # in turn order
        self._holder: Turn | None = None  # the save admitted last

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return SaveSlot, ()  # a pickled writer (process executor) starts with a free slot

    def issue(self, staged: object) -> Turn:
        """Give the save whose state dict was just staged, on the caller's thread, the next turn."""
        with self._lock:
            turn = Turn(self._next_number(), staged=staged)
            self._waiting.append(turn)
        return turn

    def _next_number(self) -> int:
        """The caller's save's number among the saves on its group (under the lock)."""
        return next(self._numbers.setdefault(save_group(), itertools.count()))

    def enter(self, set_up: bool) -> int | None:
        """Wait for this save's turn and hold the slot; the save's number, or None when this
        thread holds the slot already (a later begin call of the same save: ``reset``, then
        ``storage_meta``, then ``set_up_storage_writer``, which passes ``set_up=True``).

        Called outside ``dcp.save`` (a writer driven by hand) it neither waits nor holds.
        """
        me = threading.current_thread()
        if not thread_in_save(me.ident):
            with self._lock:
                return self._next_number()
        with self._lock:
            if self._holder is not None and self._holder.thread is me:
                if not self._holder.set_up:
                    self._holder.set_up = set_up
                    return None
                self._holder.ended = True  # else a save waiting before this one would wait for it
            turn = self._claim(me)
        while not self._take(turn):
            time.sleep(POLL_SECONDS)
        turn.set_up = set_up
        return turn.number

    def wait_idle(self) -> None:
        """Wait until the save holding the slot (on another thread) has ended."""
        me = threading.current_thread()
        while True:
            with self._lock:
                holder = self._holder
            if holder is None or holder.thread is me or holder.over():
                return
            time.sleep(POLL_SECONDS)

    def _claim(self, me: threading.Thread) -> Turn:
        """The turn issued for the state dict this thread saves, or a new one at the end."""
        saving = [frame.f_locals.get("state_dict") for frame in _own_frames(_SAVE_CODES)]
        for turn in self._waiting:
            if turn.thread is None and any(turn.staged is state_dict for state_dict in saving):
                turn.thread, turn.staged = me, None
                return turn
        turn = Turn(self._next_number(), thread=me)
        self._waiting.append(turn)
        return turn

    def _take(self, turn: Turn) -> bool:
        with self._lock:
            holder = self._holder  # a previous save of this thread is over: one thread, one save at a time
            if holder is not None and holder.thread is not turn.thread and not holder.over():
                return False
            while self._waiting[0] is not turn and self._waiting[0].over():
                self._waiting.pop(0)
            if self._waiting[0] is not turn:
                return False
            self._holder = self._waiting.pop(0)
            return True


class DirectorySaves:
    """The saves into each directory in this process, in call order (see the module
    docstring). Without it, an async save and a save through another writer into the same
    directory ran at once: each took the other's files for a dead save's and removed them,
    both reported success, and every checkpoint there was lost. Without the async save's
    place held from its call, the plain save called after it could run first, and the
    directory ended with the older state.

    Each directory has a queue of ``Turn``s: the first one runs, the others wait. A save is
    known by its thread. One it lets in is over once that thread has left ``dcp.save``, or
    is starting another save (``starting``: a thread runs one save at a time, and one that
    waits at the start of its next save, for a turn or a directory, must not be waited for).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, list[Turn]] = {}
        self._starting: collections.Counter[int] = collections.Counter()  # threads in ``starting``

    def reserve(self, location: Location, turn: Turn) -> None:
        """Hold the place of an async save in ``location`` from its call, on the caller's
        thread: ``turn`` is its writer's, which its upload thread claims (``SaveSlot``)."""
        with self._lock:
            self._queues.setdefault(location.cache_key(), []).append(turn)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """The calling thread is at the start of a save inside."""
        me = threading.get_ident()
        with self._lock:
            self._starting[me] += 1
        try:
            yield
        finally:
            with self._lock:
                self._starting[me] -= 1
                if not self._starting[me]:
                    del self._starting[me]

    def enter(self, location: Location) -> None:
        """Wait until the saves before the caller's into ``location`` are over, then run it there."""
        me = threading.current_thread()
        key = location.cache_key()
        with self.starting():
            with self._lock:
                self._queues = {k: queue for k, queue in self._queues.items() if not all(map(self._over, queue))}
                queue = self._queues.setdefault(key, [])
                mine = next((turn for turn in queue if turn.thread is me and not turn.admitted), None)  # reserved
                if mine is None:
                    mine = Turn(-1, thread=me)
                    queue.append(mine)
            while True:
                with self._lock:
                    while queue[0] is not mine and self._over(queue[0]):
                        queue.pop(0)
                    if queue[0] is mine:
                        mine.admitted = True
                        return
                time.sleep(POLL_SECONDS)

    def _over(self, turn: Turn) -> bool:
        """Whether ``turn``'s save is over (under the lock): as its writer sees it, and for one
        let in, also once its thread is this one or starts another save."""
        thread = turn.thread
        if turn.admitted and (thread is threading.current_thread() or thread.ident in self._starting):
            return True
        return turn.over()


DIRECTORY_SAVES = DirectorySaves()


@dataclasses.dataclass(frozen=True)
class OpenSave:
    """A save the coordinator planned: where, its data-file token, and the thread running it."""

    location: Location
    token: str
    save_id: str
    created_dir: bool  # the save created its directory: remove it when empty
    thread: int = dataclasses.field(default_factory=threading.get_ident)

    def discard(self) -> None:
        """Best effort: remove the save's files (and its directory when it created it)."""
        try:
            removed = discard_save(self.location, self.token, self.save_id, self.created_dir)
        except (OSError, CheckpointError) as exc:  # the store's own failures arrive as CheckpointError
            log.warning("%s: could not remove the files of failed save %s: %s", self.location.url, self.token, exc)
            return
        if removed:
            log.info("%s: removed %d file(s) of failed save %s", self.location.url, len(removed), self.token)


class OpenSaves:
    """Process-wide registry of uncommitted saves (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saves: dict[str, OpenSave] = {}

    def track(self, save: OpenSave) -> None:
        with self._lock:
            self._saves[save.token] = save

    def committed(self, token: str) -> None:
        """From the commit point on, the save's files belong to a checkpoint."""
        with self._lock:
            self._saves.pop(token, None)

    def discard_failed(self) -> None:
        """Remove the files of every tracked save whose thread has left ``dcp.save``.

        A save of the calling thread is over too: one thread runs one save at a time.
        """
        me = threading.get_ident()
        with self._lock:
            dead = [s for s in self._saves.values() if s.thread == me or not thread_in_save(s.thread)]
            for save in dead:
                del self._saves[save.token]
        for save in dead:
            save.discard()

    def discard_now(self, token: str) -> None:
        """The save failed where the caller saw it (its commit): remove its files now."""
        with self._lock:
            save = self._saves.pop(token, None)
        if save is not None:
            save.discard()


OPEN_SAVES = OpenSaves()


@contextlib.contextmanager
def discard_on_failure(token: str):  # noqa: ANN201
    """Run a coordinator step; if it raises before the commit point, remove the save's files."""
    try:
        yield
    except BaseException:
        OPEN_SAVES.discard_now(token)
        raise


@dataclasses.dataclass(frozen=True)
class SaveOrder:
    """What each rank's local plan tells the coordinator about the save it is part of: equal
    on every rank when the ranks pair the same saves (``SaveSlot`` turns). Its presence also
    tells ``ShardSavePlanner`` that the writer files TP-replica copies in its index."""

    number: int  # the save's turn among the saves on its process group through this rank's writer
    checkpoint: str


def check_same_save(plans: list[SavePlan]) -> None:
    """Refuse a save whose ranks are each running a different one of their saves.

    Skipped when a planner dropped the local plans' storage data.
    """
    orders = [plan.storage_data for plan in plans]
    if not all(isinstance(order, SaveOrder) for order in orders) or len(set(orders)) == 1:
        return
    ranks = "; ".join(f"rank {rank}: its save #{order.number}, into {order.checkpoint}" for rank, order in enumerate(orders))
    raise CheckpointError(
        f"{orders[0].checkpoint}: the ranks paired different saves in one dcp.save ({ranks}); nothing was "
        "written. Saves through one writer not awaited in between run in call order when the writer stages "
        "them; saves staged by another stager (dcp.async_save(async_stager=...)) run in the order their "
        "upload threads reach the writer, which can differ between ranks: wait for each one's future "
        "before the next, or leave async_stager out"
    )
