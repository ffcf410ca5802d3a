"""Replica check of the pieces a save planner split overlapping chunks into.

Nonuniform TP replicas declare the same rows in different chunks (a reduced replica's
[0, 4) against a healthy core's [0, 2)); the planner splits them at every boundary and one
holder writes each piece. The plan-time replica check compares chunks declared alike, so
split pieces need their own: every rank digests the pieces it holds (the planner's
``piece_digests``), the digests travel with its write results, and the coordinator compares
them before the commit point. A mismatch fails the save like any other replica mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from dcp_ext.errors import ReplicaMismatchError

PieceDigest = tuple[str, tuple[int, ...], tuple[int, ...], bytes]  # fqn, offsets, sizes, digest
_MARKER = MetadataIndex("__dcp_ext_piece_digests__")  # never a state-dict key: our results only


@dataclass(frozen=True)
class PieceDigests:
    rank: int
    digests: tuple[PieceDigest, ...]


def with_piece_digests(results: list[WriteResult], rank: int, digests: tuple[PieceDigest, ...]) -> list[WriteResult]:
    """A rank's write results, plus its piece digests when it holds split pieces."""
    return [*results, WriteResult(_MARKER, 0, PieceDigests(rank, digests))] if digests else results


def split_piece_digests(results: list[list[WriteResult]]) -> tuple[list[list[WriteResult]], list[PieceDigests]]:
    """(the write results without digests, every rank's digests)."""
    pieces = [r.storage_data for rank in results for r in rank if r.index == _MARKER]
    return [[r for r in rank if r.index != _MARKER] for rank in results] if pieces else results, pieces


def check_piece_digests(pieces: list[PieceDigests], where: str) -> None:
    """Raise ReplicaMismatchError where holders of one split piece hold different data."""
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], dict[bytes, list[int]]] = {}
    for piece in pieces:
        for fqn, offsets, sizes, digest in piece.digests:
            holders.setdefault((fqn, offsets, sizes), {}).setdefault(digest, []).append(piece.rank)
    bad = [(box, versions) for box, versions in holders.items() if len(versions) > 1]
    if bad:
        detail = "; ".join(
            f"{fqn!r} chunk at offsets {list(offsets)} size {list(sizes)}: "
            + " vs ".join(f"ranks {sorted(ranks)}" for ranks in versions.values())
            for (fqn, offsets, sizes), versions in bad[:5]
        )
        raise ReplicaMismatchError(
            f"{where}: {len(bad)} pieces of replicas split across different chunks hold different data ({detail}); "
            "replicas that diverged: no copy is saved"
        )
