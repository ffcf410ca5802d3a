"""The DCP key of a TP-replica copy: the canonical chunk's key plus the TP rank writing it.

With replica locality (``dcp_ext.planning.locality``) a replicated chunk is written once
more by every TP group that holds it. The copies travel through DCP's save plans and write
results beside the canonical item, so each needs a key of its own that still names the
chunk it duplicates. ``ReplicaCopyIndex`` is that key: a ``MetadataIndex`` with the TP
rank as a typed field. Dataclass equality checks the class, so a copy never equals its
canonical item and DCP's dicts keep the two apart; the writer records copies only in our
index (never in ``.metadata``) under ``canonical``.

It lives in ``formats`` because both the planner (which makes copies) and the storage
writer (which files them) need it, and storage may not import planning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import MetadataIndex


@dataclass(frozen=True)
class ReplicaCopyIndex(MetadataIndex):
    """The key of one TP-replica copy of the chunk ``MetadataIndex(fqn, offset)``."""

    tp_rank: int = field(kw_only=True)  # the TP coordinate whose file holds this copy

    def __init__(
        self, fqn: str, offset: Sequence[int] | None = None, index: int | None = None, *, tp_rank: int
    ) -> None:
        """Torch's constructor (it turns ``offset`` into a ``torch.Size``) plus ``tp_rank``;
        ``dataclasses.replace`` passes every field back through here."""
        super().__init__(fqn, offset, index)
        object.__setattr__(self, "tp_rank", tp_rank)

    @classmethod
    def of(cls, index: MetadataIndex, tp_rank: int) -> ReplicaCopyIndex:
        """The key of ``tp_rank``'s copy of the chunk ``index`` names (its index hint kept)."""
        return cls(index.fqn, index.offset, index.index, tp_rank=tp_rank)

    @property
    def canonical(self) -> MetadataIndex:
        """The plain key of the chunk this copies, as ``.metadata`` and our index name it."""
        return MetadataIndex(self.fqn, self.offset, self.index)
