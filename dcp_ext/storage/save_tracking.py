"""Which saves are running, and which ended without a commit.

DCP gives a ``StorageWriter`` no hook when a save fails: ``write_data`` returns, the
coordinator gathers every rank's result and calls ``finish`` only when all succeeded; a
failure anywhere is raised from ``dcp.save`` on every rank without another writer call.
The writer's own view of a save therefore ends in one of two ways: it passes its commit
point, or the thread that ran it leaves ``dcp.save``. This module watches the second.

* ``SaveSlot``: one save at a time through a writer, whichever stager staged it. With DCP's
  thread executor every ``dcp.async_save`` runs ``dcp.save`` on a new thread, so an
  explicit ``async_stager`` lets saves through one writer overlap and clobber its per-save
  state (directory, save id), writing into each other's directories. A save waits where
  it begins (``reset``, ``set_up_storage_writer``), before its first collective, until
  the thread of the previous save left ``dcp.save`` (so that save's collectives, the
  result broadcast included, are all done on this rank). Waiting saves go in the order
  they reached the writer.
* ``OPEN_SAVES``: saves a coordinator planned but has not committed, process-wide. Once
  the thread that ran one has left ``dcp.save`` it failed; the next save (through any
  writer) or ``ShardWriter.close()`` removes its files from its directory, including
  files another rank finished after the failing rank had cleaned up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import sys
import threading
import time

from torch.distributed.checkpoint import state_dict_saver

from dcp_ext.storage.commit import discard_save
from dcp_ext.storage.location import Location

log = logging.getLogger("dcp_ext")

POLL_SECONDS = 0.01
_SAVE_FUNCTIONS = ("save", "save_state_dict", "_save_state_dict")  # whichever this torch has
_SAVE_CODES = frozenset(
    inspect.unwrap(fn).__code__
    for fn in (getattr(state_dict_saver, name, None) for name in _SAVE_FUNCTIONS)
    if fn is not None
)


def thread_in_save(ident: int | None) -> bool:
    """Whether thread ``ident`` is inside ``dcp.save`` (or the deprecated ``save_state_dict``)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        if frame.f_code in _SAVE_CODES:
            return True
        frame = frame.f_back
    return False


class SaveSlot:
    """Admits one ``dcp.save`` at a time; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread of the last save admitted
        self._queue: list[int] = []  # threads waiting, in arrival order

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return SaveSlot, ()  # a pickled writer (process executor) starts with a free slot

    def enter(self) -> None:
        """Wait until no other thread runs a save through this writer, then hold the slot.

        Called outside ``dcp.save`` (a writer driven by hand) it neither waits nor holds.
        """
        me = threading.get_ident()
        if not thread_in_save(me):
            return
        with self._lock:
            if self._holder != me and me not in self._queue:
                self._queue.append(me)
        while not self._take(me):
            time.sleep(POLL_SECONDS)

    def wait_idle(self) -> None:
        """Wait until the save holding the slot (on another thread) has ended."""
        while self._busy(threading.get_ident()):
            time.sleep(POLL_SECONDS)

    def _busy(self, me: int) -> bool:
        with self._lock:
            return self._holder not in (None, me) and thread_in_save(self._holder)

    def _take(self, me: int) -> bool:
        with self._lock:
            if self._holder == me:  # reset and set_up_storage_writer of one save
                return True
            if self._holder is not None and thread_in_save(self._holder):
                return False
            self._queue = [t for t in self._queue if t == me or thread_in_save(t)]
            if self._queue[0] != me:
                return False
            self._queue.pop(0)
            self._holder = me
            return True


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
        except OSError as exc:
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
