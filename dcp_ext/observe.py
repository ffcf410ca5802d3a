"""Per-phase timing and byte counts of every save and load, per rank.

``ShardWriter`` and ``ShardReader`` time the phases DCP drives them through and, when an
operation ends on a rank, publish one report: a log record on the ``"dcp_ext"`` logger
(INFO, a one-line summary, the report's dict in ``record.dcp_ext``), then the
reader's/writer's own ``on_report`` callback, then every process-wide callback added with
``add_report_callback``. A failing callback is logged and skipped, never raised: a
checkpoint must not fail because its monitoring did.

Callbacks run in the thread that finished the operation: under ``dcp.async_save`` that
is DCP's background thread, or the checkpoint process with
``AsyncCheckpointerType.PROCESS`` (there only a picklable ``on_report`` travels with the
writer; callbacks added in the training process are not seen).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from dcp_ext.errors import InvalidRequestError

LOGGER = logging.getLogger("dcp_ext")
SAVE_PHASES = ("plan", "write", "metadata", "commit")
LOAD_PHASES = ("metadata", "plan", "read", "exchange")


@dataclasses.dataclass(frozen=True)
class _Report:
    """Fields every report shares; ``seconds`` maps each phase, then ``total``, to seconds."""

    kind: ClassVar[str]
    checkpoint: str
    rank: int
    is_coordinator: bool
    seconds: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, ``kind`` first."""
        return {"kind": self.kind, **dataclasses.asdict(self)}

    def summary(self) -> str:
        """One line: what, where, each phase's milliseconds, then the counts."""
        shared = {f.name for f in dataclasses.fields(_Report)}
        phases = " ".join(f"{name}={seconds * 1e3:.1f}ms" for name, seconds in self.seconds.items())
        counts = " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if f.name not in shared)
        return f"{self.kind} rank {self.rank} {self.checkpoint}: {phases}; {counts}"


@dataclasses.dataclass(frozen=True)
class SaveReport(_Report):
    """One rank's part of one save.

    Phases: ``plan`` (set-up to the start of writing: DCP's local and global planning),
    ``write`` (this rank's data files), ``metadata`` and ``commit`` (building ``.metadata``
    and the index; publishing them and removing retired files: coordinator only, else 0).
    ``total`` runs from set-up to this rank's last phase, so it also holds the waits for
    other ranks. ``bytes_written`` counts this rank's data files (their size on disk);
    ``metadata_bytes`` the ``.metadata`` and index the coordinator wrote.
    """

    kind: ClassVar[str] = "save"
    bytes_written: int
    files_written: int
    items_written: int
    metadata_bytes: int


@dataclasses.dataclass(frozen=True)
class LoadReport(_Report):
    """One rank's part of one load.

    Phases: ``metadata`` (reading/parsing ``.metadata`` or taking it from the cache),
    ``plan`` (from then to the start of reading), ``read`` (storage reads and copies into
    the destinations), ``exchange`` (two-stage loads: the collectives and transfers between
    ranks, else 0). ``bytes_read`` came from storage, ``bytes_received`` from other ranks.
    """

    kind: ClassVar[str] = "load"
    bytes_read: int
    bytes_received: int
    files_opened: int
    items_read: int
    metadata_reads: int


Report = SaveReport | LoadReport
ReportCallback = Callable[[Report], None]

_callbacks: list[ReportCallback] = []
_callbacks_lock = threading.Lock()


def add_report_callback(fn: ReportCallback) -> None:
    """Call ``fn(report)`` for every save and load report of this process (once, if added twice)."""
    if not callable(fn):
        raise InvalidRequestError(f"add_report_callback(fn) needs a callable, got {fn!r}")
    with _callbacks_lock:
        if fn not in _callbacks:
            _callbacks.append(fn)


def remove_report_callback(fn: ReportCallback) -> None:
    """Stop calling ``fn``; a callback that was never added is ignored."""
    with _callbacks_lock:
        if fn in _callbacks:
            _callbacks.remove(fn)


def publish(report: Report, on_report: ReportCallback | None) -> None:
    """Log the report, then hand it to ``on_report`` and every process-wide callback."""
    LOGGER.info("%s", report.summary(), extra={"dcp_ext": report.to_dict()})
    with _callbacks_lock:
        callbacks = ([on_report] if on_report else []) + _callbacks
    for fn in callbacks:
        try:
            fn(report)
        except Exception:  # monitoring must never fail the checkpoint
            LOGGER.warning("report callback %r failed on the %s report of rank %d", fn, report.kind, report.rank,
                           exc_info=True)


class PhaseClock:
    """Wall-clock seconds of one operation's phases on one rank, from its start."""

    def __init__(self, phases: tuple[str, ...]):
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(phases, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as (part of) phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def charge_rest(self, name: str) -> None:
        """Give ``name`` every second since the start that no phase holds yet.

        For phases bounded by two hooks rather than one call: DCP's planning runs between
        set-up and the first write/read, outside any storage method.
        """
        self.seconds[name] += max(0.0, self.elapsed() - sum(self.seconds.values()))

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def totals(self) -> dict[str, float]:
        """Each phase, then ``total``: the seconds since the start."""
        return {**self.seconds, "total": self.elapsed()}
