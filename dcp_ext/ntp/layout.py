"""Which rows of a TP-partitioned dimension each rank owns under nonuniform TP.

Nonuniform tensor parallelism keeps a job training after GPU failures: the first
``num_reduced_tp_dp_ranks`` data-parallel replicas run at a reduced TP degree
``r = tp_base - tp_spares`` on their surviving ranks, while healthy replicas keep
``tp_base`` ranks, ``r`` "core" ranks laid out like the reduced replica plus
``tp_spares`` spares that take over part of every core's rows. A checkpoint stores the
natural global tensors, so a layout is only needed to say which rows a rank holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from dcp_ext.errors import InvalidRequestError

Range = tuple[int, int]  # [start, stop) along the partition dimension


@dataclasses.dataclass(frozen=True)
class NonuniformTP:
    """An NTP layout (Megatron's ``NonuniformTPConfig``, keyed by DP rank only).

    Args:
        tp_base: TP degree of a healthy replica.
        tp_spares: ranks a reduced replica runs without; ``r = tp_base - tp_spares``.
        num_reduced_tp_dp_ranks: the first this many DP replicas run at degree ``r``.
        non_active_ranks_per_dp: failed TP slots of a reduced replica (exactly
            ``tp_spares`` of them); by default its last ``tp_spares`` slots.
    """

    tp_base: int
    tp_spares: int
    num_reduced_tp_dp_ranks: int = 1
    non_active_ranks_per_dp: Mapping[int, Sequence[int]] | None = None

    def __post_init__(self) -> None:
        for name in ("tp_base", "tp_spares", "num_reduced_tp_dp_ranks"):
            if type(getattr(self, name)) is not int:
                raise InvalidRequestError(f"NonuniformTP({name}=...) must be an integer, got {getattr(self, name)!r}")
        if self.tp_base < 1 or not 0 <= self.tp_spares < self.tp_base:
            raise InvalidRequestError(f"need tp_base >= 1 and 0 <= tp_spares < tp_base, got {self.tp_base}, {self.tp_spares}")
        if self.num_reduced_tp_dp_ranks < 0:
            raise InvalidRequestError(f"num_reduced_tp_dp_ranks must be >= 0, got {self.num_reduced_tp_dp_ranks}")
        for dp_rank, slots in (self.non_active_ranks_per_dp or {}).items():
            if not 0 <= dp_rank < self.num_reduced_tp_dp_ranks:
                raise InvalidRequestError(
                    f"non_active_ranks_per_dp names DP replica {dp_rank}, but only replicas "
                    f"0..{self.num_reduced_tp_dp_ranks - 1} run at reduced TP"
                )
            if len(set(slots)) != self.tp_spares or not all(0 <= s < self.tp_base for s in slots):
                raise InvalidRequestError(
                    f"DP replica {dp_rank}: a reduced replica lists exactly tp_spares={self.tp_spares} "
                    f"distinct non-active slots in [0, {self.tp_base}), got {list(slots)}"
                )

    @property
    def reduced_tp(self) -> int:
        return self.tp_base - self.tp_spares

    def is_reduced(self, dp_rank: int) -> bool:
        return self.tp_spares > 0 and dp_rank < self.num_reduced_tp_dp_ranks

    def active_slots(self, dp_rank: int) -> list[int]:
        """TP slots of a replica that run (and hold rows), in TP-rank order."""
        if not self.is_reduced(dp_rank):
            return list(range(self.tp_base))
        failed = set((self.non_active_ranks_per_dp or {}).get(dp_rank, range(self.reduced_tp, self.tp_base)))
        return [s for s in range(self.tp_base) if s not in failed]

    def row_map(self, dp_rank: int, tp_slot: int, size: int, unit: int = 1) -> list[Range]:
        """Ranges of ``size`` rows owned by ``tp_slot`` of replica ``dp_rank``, ascending.

        ``unit`` rows move together (a head's rows, say): ``size`` must be a multiple of it.
        A reduced replica's j-th active slot owns ``torch.chunk(arange(units), r)[j]``; a
        healthy core c keeps ``units/tp_base`` units at the start of that chunk, and the rest
        of every core chunk is dealt unit by unit, round-robin, to the spares.
        """
        if dp_rank < 0 or not 0 <= tp_slot < self.tp_base:
            raise InvalidRequestError(f"no TP slot {tp_slot} in DP replica {dp_rank} (tp_base={self.tp_base})")
        if unit < 1 or size < 0 or size % unit:
            raise InvalidRequestError(f"size {size} is not a whole number of units of {unit} rows")
        units = size // unit
        if self.is_reduced(dp_rank):
            active = self.active_slots(dp_rank)
            if tp_slot not in active:
                raise InvalidRequestError(f"TP slot {tp_slot} of reduced DP replica {dp_rank} is not active (active: {active})")
            owned = list(range(*_chunk(units, self.reduced_tp, active.index(tp_slot))))
        elif self.tp_spares == 0:
            owned = list(range(*_chunk(units, self.tp_base, tp_slot)))
        else:
            owned = self._healthy_units(units, tp_slot)
        return [(start * unit, stop * unit) for start, stop in _runs(owned)]

    def _healthy_units(self, units: int, tp_slot: int) -> list[int]:
        r = self.reduced_tp
        if units % self.tp_base or units % r:
            raise InvalidRequestError(
                f"{units} units cannot be split over a healthy NTP replica: the count must be a "
                f"multiple of tp_base={self.tp_base} and of the reduced degree {r}"
            )
        keep, part = units // self.tp_base, units // r
        if tp_slot < r:
            return list(range(tp_slot * part, tp_slot * part + keep))
        tails = [u for core in range(r) for u in range(core * part + keep, (core + 1) * part)]
        return tails[tp_slot - r :: self.tp_spares]


def _chunk(units: int, parts: int, index: int) -> Range:
    """``torch.chunk`` semantics: parts of ceil(units/parts); trailing ones may be empty."""
    step = -(-units // parts)
    start = min(index * step, units)
    return start, min(start + step, units)


def _runs(owned: list[int]) -> list[Range]:
    """Ascending unit indices -> maximal [start, stop) runs."""
    runs: list[Range] = []
    for u in owned:
        if runs and runs[-1][1] == u:
            runs[-1] = (runs[-1][0], u + 1)
        else:
            runs.append((u, u + 1))
    return runs
