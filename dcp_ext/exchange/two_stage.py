"""Two-stage loading: each stored byte range is read once per group, then exchanged.

When DP replicas (or any ranks) need the same bytes, a plain load makes every one of them
read those bytes from storage. Here every rank first publishes the byte ranges its
requests need; all ranks compute the same plan: overlapping ranges merge into segments
(cut at ``SEGMENT_BYTES``), and each segment is read by one of the ranks that need it,
largest segments first to the least loaded rank. Segments are processed in batches of at
most half of ``budget_bytes`` (the next batch is read while the current one is being
exchanged): the assigned ranks read them, every rank learns whether all reads succeeded
(so a failed read raises the same error everywhere instead of hanging the others), the
readers send each other rank exactly the bytes it needs (point-to-point: gloo with CPU
buffers, NCCL with buffers on the rank's current GPU), and each rank copies the bytes
into its requests' destinations.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dcp_ext.errors import CheckpointError
from dcp_ext.formats.torch_record import host_bytes
from dcp_ext.observe import PhaseClock
from dcp_ext.runtime.threads import StartedPool
from dcp_ext.storage.executors import TASK_BYTES, LoadIdentity, ReadSettings, file_tasks, register_executor, task_limit
from dcp_ext.storage.read_plan import Request

SEGMENT_BYTES = 32 << 20  # largest unit one rank reads and sends


@dataclass
class Segment:
    """A run of stored bytes one rank reads for everyone who needs part of it."""

    path: str
    start: int
    end: int
    needs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # rank -> [(start, end)]
    reader: int = -1

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def wanted(self, rank: int) -> list[tuple[int, int]]:
        """The parts of this segment ``rank`` needs: clipped, merged, in file order."""
        merged: list[tuple[int, int]] = []
        for a, b in sorted((max(a, self.start), min(b, self.end)) for a, b in self.needs.get(rank, [])):
            if a >= b:
                continue
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged


def plan_segments(needs: Sequence[Sequence[tuple[str, int, int]]]) -> list[Segment]:
    """Same result on every rank: merged, size-capped segments with balanced readers."""
    by_path: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for rank, ranges in enumerate(needs):
        for path, offset, length in ranges:
            if length:
                by_path[path].append((offset, offset + length, rank))
    segments: list[Segment] = []
    for path in sorted(by_path):
        spans = sorted(by_path[path])
        start, end, members = spans[0][0], spans[0][1], [spans[0]]
        for span in spans[1:]:
            if span[0] < end:  # overlaps the open run: the same stored bytes
                end = max(end, span[1])
                members.append(span)
            else:
                segments.extend(_cut(path, start, end, members))
                start, end, members = span[0], span[1], [span]
        segments.extend(_cut(path, start, end, members))
    _assign_readers(segments, len(needs))
    return segments


def _cut(path: str, start: int, end: int, members: list[tuple[int, int, int]]) -> list[Segment]:
    pieces = []
    for a in range(start, end, SEGMENT_BYTES):
        b = min(end, a + SEGMENT_BYTES)
        segment = Segment(path, a, b)
        for lo, hi, rank in members:
            if lo < b and a < hi:
                segment.needs.setdefault(rank, []).append((lo, hi))
        pieces.append(segment)
    return pieces


def _assign_readers(segments: list[Segment], world: int) -> None:
    load = [0] * world
    for segment in sorted(segments, key=lambda s: (-s.nbytes, s.path, s.start)):
        segment.reader = min(segment.needs, key=lambda r: (load[r], r))
        load[segment.reader] += segment.nbytes


def _batches(segments: list[Segment], budget: int) -> list[list[int]]:
    batches: list[list[int]] = [[]]
    size = 0
    for n, segment in enumerate(segments):
        if batches[-1] and size + segment.nbytes > budget:
            batches.append([])
            size = 0
        batches[-1].append(n)
        size += segment.nbytes
    return [b for b in batches if b]


@dataclass(frozen=True)
class _Piece:
    """One byte range of one request: file bytes [offset, offset + length)."""

    request: int
    range_no: int
    offset: int
    length: int


class TwoStageExchange:
    """Runs one rank's requests through a group-wide read-once-and-exchange.

    After ``run``, ``seconds`` holds the time this rank spent in the group's collectives
    and transfers (storage reads overlap them in a prefetch thread and are not counted)
    and ``bytes_received`` the bytes other ranks sent it.
    """

    collective = True

    def __init__(self, settings: ReadSettings):
        self.location = settings.location
        self.group = settings.group
        self.budget_bytes = settings.budget_bytes
        self.thread_count = settings.thread_count
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        # NCCL moves only CUDA tensors: stage transfers on this rank's GPU there.
        nccl = dist.get_backend(self.group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.clock = PhaseClock(("exchange",))
        self.bytes_received = 0

    def run(
        self,
        requests: Iterable[Request],
        identity: LoadIdentity,
        planning_error: BaseException | None = None,
        expected_bytes: int = 0,
        expected_files: int = 0,
        in_memory: bool = False,
    ) -> tuple[int, set[str]]:
        """Fill every request; returns (bytes this rank read from storage, files it opened).
        The group plans its own reads, so ``expected_bytes``, ``expected_files`` and
        ``in_memory`` (a local reader's task and pool sizes) are not needed.

        Every rank must call this, even one whose planning failed (pass the error): the
        failure is shared in the first collective and raised on every rank alike, as is a
        group whose members load different checkpoints or that is not dcp.load's group.
        """
        requests = list(requests)
        mine = [(r.path, offset, length) for r in requests for offset, length in r.ranges]
        published = _describe(planning_error) if planning_error else mine
        everyone: list = [None] * self.world
        with self.clock.phase("exchange"):
            dist.all_gather_object(everyone, (identity, self.budget_bytes, published), group=self.group)
        self._check_one_load([who for who, _, _ in everyone])
        # the smallest budget any rank gave: ranks that batched by their own budgets made
        # different numbers of collectives and waited for each other until the timeout
        budget = min(given for _, given, _ in everyone)
        everyone = [needs for _, _, needs in everyone]
        self._raise_if_failed([e if isinstance(e, str) else None for e in everyone], "planning the load")
        segments = plan_segments(everyone)
        pieces = _Pieces(requests)
        bytes_read, files = 0, set()
        # Two batches are in flight (one exchanged while the next is read), so each gets half.
        batches = _batches(segments, max(1, budget // 2))
        # A piece that fails its checks as it lands (a checksum, a decode) fails on the ranks
        # that need it only: the others are already in the next batch's collective, so the
        # failure is shared there, like a read error; after the last batch every rank goes on
        # to dcp.load's own gather, which reports it everywhere.
        fill_failure: Exception | None = None
        with StartedPool(1, "dcp_ext-prefetch") as prefetch, self._read_pool(segments) as pool:
            pending = prefetch.submit(self._read, segments, batches[0], pool) if batches else None
            for position, batch in enumerate(batches):
                buffers, read, error = pending.result()
                if position + 1 < len(batches):
                    pending = prefetch.submit(self._read, segments, batches[position + 1], pool)
                self._agree(error or (_describe(fill_failure) if fill_failure else None))
                bytes_read += read
                files.update(segments[n].path for n in batch if segments[n].reader == self.rank)
                with self.clock.phase("exchange"):
                    received = self._exchange(segments, batch, buffers)
                try:
                    for n in batch:
                        pieces.fill(segments[n], buffers.get(n), received.get(n), self.rank)
                except Exception as exc:
                    fill_failure = exc
        if fill_failure is not None:
            raise fill_failure
        pieces.finish()
        return bytes_read, files

    def _read_pool(self, segments: list[Segment]) -> StartedPool:
        """One pool for the load's reads, started before the first (a thread started while
        others read waits for the GIL): no more threads than this rank's tasks can be."""
        mine = [s for s in segments if s.reader == self.rank]
        tasks = len({s.path for s in mine}) + sum(s.nbytes for s in mine) // TASK_BYTES
        return StartedPool(max(1, min(self.thread_count, tasks)), "dcp_ext-read")

    def _read(
        self, segments: list[Segment], batch: list[int], pool: StartedPool
    ) -> tuple[dict[int, torch.Tensor], int, str | None]:
        """Read this rank's segments of the batch; errors are reported, not raised. One
        buffer for them all, and each file opened once per task (``file_tasks``, as the
        plain reader cuts them), its segments read in one call: a column-sharded load has a
        segment per row (65,536 of 8 KiB for 512 MB), and a buffer and an open per segment
        took 10x the plain reader's time."""
        mine = [n for n in batch if segments[n].reader == self.rank]  # in file order, as segments are
        block = torch.empty(sum(segments[n].nbytes for n in mine), dtype=torch.uint8)
        data = host_bytes(block)
        buffers, views, position = {}, {}, 0
        for n in mine:
            end = position + segments[n].nbytes
            buffers[n], views[id(segments[n])] = block[position:end], data[position:end]
            position = end

        def read(task: list[Segment]) -> int:
            with self.location.open_reader(task[0].path) as reader:
                return reader.read_runs([(segment.start, [views[id(segment)]]) for segment in task])

        tasks = list(file_tasks([segments[n] for n in mine], task_limit(position, self.thread_count)))
        try:
            return buffers, sum(pool.map(read, tasks)), None
        except Exception as exc:  # shared with every rank below, then raised everywhere
            return buffers, 0, _describe(exc)

    def _agree(self, error: str | None) -> None:
        errors: list[str | None] = [None] * self.world
        with self.clock.phase("exchange"):
            dist.all_gather_object(errors, error, group=self.group)
        self._raise_if_failed(errors, "reading from storage")

    def _check_one_load(self, identities: list[LoadIdentity]) -> None:
        """Segments are keyed by file name only: members must load one checkpoint (that the
        default group, the whole job, is dcp.load's own the reader checks before any
        exchange). Every rank sees the same list, so all raise alike."""
        if len(set(identities)) > 1:
            detail = "; ".join(f"rank {rank}: {i.location} (metadata {i.fingerprint:#010x})" for rank, i in enumerate(identities))
            raise CheckpointError(
                f"two-stage load: the exchange group's members load different checkpoints ({detail}); "
                "pass ShardReader(group=...) the process group given to dcp.load"
            )

    def _raise_if_failed(self, errors: list[str | None], phase: str) -> None:
        failed = [(rank, e) for rank, e in enumerate(errors) if e]
        if failed:
            detail = "; ".join(f"rank {rank}: {e}" for rank, e in failed)
            raise CheckpointError(f"{self.location.url}: two-stage load failed {phase} ({detail})")

    def _exchange(
        self, segments: list[Segment], batch: list[int], buffers: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Readers send each needing rank its bytes; returns what this rank received."""
        ops, received = [], {}
        for n in batch:
            segment = segments[n]
            if segment.reader == self.rank:
                for rank in segment.needs:
                    if rank != self.rank:
                        spans = segment.wanted(rank)
                        payload = torch.cat([buffers[n][a - segment.start : b - segment.start] for a, b in spans])
                        ops.append(dist.P2POp(dist.isend, payload.to(self.device), self._peer(rank), self.group, tag=n))
            elif self.rank in segment.needs:
                size = sum(b - a for a, b in segment.wanted(self.rank))
                received[n] = torch.empty(size, dtype=torch.uint8, device=self.device)
                ops.append(dist.P2POp(dist.irecv, received[n], self._peer(segment.reader), self.group, tag=n))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.bytes_received += sum(tensor.numel() for tensor in received.values())
        return {n: tensor.cpu() for n, tensor in received.items()}

    @property
    def seconds(self) -> float:
        return self.clock.seconds["exchange"]

    def _peer(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


class _Pieces:
    """This rank's requests, indexed by file position, filled segment by segment.

    A request's target memory is asked for only when its first bytes arrive and released
    (``complete``) as soon as its last byte has landed, so temporary buffers live only
    while their bytes are in transit.
    """

    def __init__(self, requests: list[Request]):
        self.requests = requests
        self.remaining = [r.nbytes for r in requests]
        self.views: dict[int, list[list[tuple[int, memoryview]]]] = {}
        self.by_path: dict[str, list[_Piece]] = defaultdict(list)
        for index, request in enumerate(requests):
            for range_no, (offset, length) in enumerate(request.ranges):
                if length:
                    self.by_path[request.path].append(_Piece(index, range_no, offset, length))
        self.starts: dict[str, list[int]] = {}
        self.longest: dict[str, int] = {}
        for path, pieces in self.by_path.items():
            pieces.sort(key=lambda p: p.offset)
            self.starts[path] = [p.offset for p in pieces]
            self.longest[path] = max(p.length for p in pieces)

    def _views(self, piece: _Piece) -> list[tuple[int, memoryview]]:
        """(file offset, target memory) covering the piece, from the request's targets."""
        if piece.request not in self.views:
            request = self.requests[piece.request]
            targets = iter(request.targets())
            per_range = []
            for offset, length in request.ranges:
                views, end = [], offset + length
                while offset < end:
                    view = next(targets)
                    views.append((offset, view))
                    offset += view.nbytes
                per_range.append(views)
            self.views[piece.request] = per_range
        return self.views[piece.request][piece.range_no]

    def fill(self, segment: Segment, whole: torch.Tensor | None, packed: torch.Tensor | None, rank: int) -> None:
        """Copy the segment's bytes (read here, or received packed) into overlapping pieces."""
        if whole is None and packed is None:
            return
        if whole is not None:
            source, position = host_bytes(whole), {segment.start: 0}
            spans = [(segment.start, segment.end)]
        else:
            source, position, cursor = host_bytes(packed), {}, 0
            spans = segment.wanted(rank)
            for a, b in spans:
                position[a] = cursor
                cursor += b - a
        pieces, starts = self.by_path[segment.path], self.starts[segment.path]
        for a, b in spans:
            first = bisect.bisect_left(starts, a - self.longest[segment.path] + 1)
            for piece in pieces[first:]:
                if piece.offset >= b:
                    break
                lo, hi = max(a, piece.offset), min(b, piece.offset + piece.length)
                if lo < hi:
                    self._copy(piece, lo, hi, source, position[a] + lo - a)

    def _copy(self, piece: _Piece, lo: int, hi: int, source: memoryview, src: int) -> None:
        """Copy file bytes [lo, hi) (at ``source[src:]``) into the piece's target memory."""
        for offset, view in self._views(piece):
            a, b = max(lo, offset), min(hi, offset + view.nbytes)
            if a < b:
                view[a - offset : b - offset] = source[src + a - lo : src + b - lo]
        self.remaining[piece.request] -= hi - lo
        if self.remaining[piece.request] == 0:
            self.requests[piece.request].complete()
            del self.views[piece.request]

    def finish(self) -> None:
        """Every byte of every request must have arrived (a bug otherwise, never silent)."""
        for request, left in zip(self.requests, self.remaining):
            if left:
                raise CheckpointError(f"two-stage load left {left} bytes of {request.path!r} key {request.key!r} unfilled")
            if not request.nbytes:  # nothing to receive: complete it here
                request.complete()


register_executor("two_stage", TwoStageExchange)


def _describe(exc: BaseException) -> str:
    """A failure as the other ranks are told of it."""
    return f"{type(exc).__name__}: {exc}"
