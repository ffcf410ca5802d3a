"""Where the files of a legacy Megatron ``torch`` checkpoint are, and whether all are there.

``{dir}/latest_checkpointed_iteration.txt`` names an iteration (or ``release``); its
files are ``iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt``
(``_pp`` only when PP>1, ``_ep`` only when EP>1). A two-number name is ambiguous, so
the parallel sizes come from the ``args`` saved in the first file when present.
"""

from __future__ import annotations

import itertools
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats.faults import shown
from dcp_ext.storage.location import Location

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
RELEASE = "release"
_ITER_DIR = re.compile(r"^iter_\d{7}$")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_ITERATION = re.compile(r"[0-9]{1,18}")  # what Megatron writes: str(iteration); int() takes no more than 4300 digits
_LISTED = 8  # missing rank files a message names; the rest it counts


@dataclass(frozen=True)
class Parallelism:
    tp: int
    pp: int
    ep: int

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.ep

    def coordinates(self) -> Iterator[tuple[int, int, int]]:
        """Every (tp, pp, ep), lazily: ``args`` may claim far more than the directory holds
        (``itertools.product`` would first make a tuple of each range: TP=2**62)."""
        return ((tp, pp, ep) for tp in range(self.tp) for pp in range(self.pp) for ep in range(self.ep))

    def rank_dir(self, tp: int, pp: int, ep: int) -> str:
        return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if self.pp > 1 else "") + (f"_{ep:03d}" if self.ep > 1 else "")

    def coordinates_of(self, name: str) -> tuple[int, int, int] | None:
        """The (tp, pp, ep) whose directory is ``name`` under these sizes, or None."""
        match = _RANK_DIR.match(name)
        if match is None:
            return None
        tp, *rest = (int(g) for g in match.groups() if g is not None)
        pp = rest.pop(0) if self.pp > 1 and rest else 0
        ep = rest.pop(0) if self.ep > 1 and rest else 0
        inside = tp < self.tp and pp < self.pp and ep < self.ep
        return (tp, pp, ep) if inside and self.rank_dir(tp, pp, ep) == name else None


def is_rank_dir(name: str) -> bool:
    return _RANK_DIR.match(name) is not None


def is_legacy(names: list[str]) -> bool:
    return any(n in (TRACKER, RELEASE) or _ITER_DIR.match(n) or _RANK_DIR.match(n) for n in names)


def resolve_iteration(location: Location, iteration: int | str | None) -> str:
    """The directory (relative; "" when ``location`` is one iteration) to load."""
    names = location.listdir()
    if iteration is None and any(_RANK_DIR.match(n) for n in names):
        return ""
    present = sorted(n for n in names if _ITER_DIR.match(n) or n == RELEASE)
    if iteration is None:
        if TRACKER in names:
            text = location.read_bytes(TRACKER).decode(errors="replace").strip()
            if text != RELEASE and not _ITERATION.fullmatch(text):
                raise CorruptCheckpointError(
                    f"{location.url}/{TRACKER}: expected an iteration number or 'release', found {shown(text)}"
                )
            iteration = text if text == RELEASE else int(text)
        elif present == [RELEASE]:
            iteration = RELEASE
        else:
            raise CheckpointError(
                f"{location.url}: no {TRACKER}; iterations present: {present or 'none'}; "
                "pass MegatronOptions(iteration=N) to choose one"
            )
    name = RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"
    if name not in names:
        raise CheckpointError(f"{location.url}: iteration directory {name!r} does not exist (present: {present or 'none'})")
    return name


def _distributed_hint(names: list[str], path: str) -> str:
    """Megatron-LM's --save root also tracks iterations saved with ``--ckpt-format
    torch_dist`` (or zarr): say so, rather than leave the root taken for a legacy save."""
    if ".metadata" in names or "metadata.json" in names:
        return f"; it holds a distributed checkpoint (torch_dist or zarr: .metadata / metadata.json): open {path} itself"
    return ""


def first_rank_file(location: Location, iteration_dir: str) -> str:
    """The TP0/PP0/EP0 file: the lexically first ``mp_rank_*`` directory."""
    names = location.listdir(iteration_dir)
    ranks = sorted(n for n in names if _RANK_DIR.match(n))
    if not ranks:
        raise CheckpointError(f"{location.url}/{iteration_dir}: no mp_rank_* directories{_distributed_hint(names, f'{location.url}/{iteration_dir}')}")
    return posixpath.join(iteration_dir, ranks[0], MODEL_FILE)


def count_arg(args: Any, name: str, source: str) -> int | None:
    """``args.<name>`` as a count; None when unset (absent, None or 0). Anything else that
    is not a positive integer is corruption of ``source``, the file ``args`` came from."""
    value = getattr(args, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CorruptCheckpointError(f"{source}: args.{name} is {shown(value)}, expected a positive integer")
    return value or None


def parallelism(location: Location, iteration_dir: str, args: Any, source: str) -> Parallelism:
    """TP/PP/EP sizes from ``args`` (saved in ``source``), else from the directory names."""
    tp = count_arg(args, "tensor_model_parallel_size", source)
    if tp:
        return Parallelism(
            tp,
            count_arg(args, "pipeline_model_parallel_size", source) or 1,
            count_arg(args, "expert_model_parallel_size", source) or 1,
        )
    numbers = [
        [int(g) for g in m.groups() if g is not None]
        for m in map(_RANK_DIR.match, location.listdir(iteration_dir))
        if m
    ]
    size = [max((n[i] for n in numbers if len(n) > i), default=0) + 1 for i in range(3)]
    if any(len(n) == 3 for n in numbers):
        return Parallelism(*size)
    return Parallelism(size[0], size[1], 1)  # no args: a second number is a PP rank


def rank_files(location: Location, iteration_dir: str, sizes: Parallelism) -> dict[tuple[int, int, int], str]:
    """Every (tp, pp, ep) -> file; raises naming the coordinates of the first missing ones.

    Work follows the directories present, not the sizes ``args`` claims (TP=PP=100000
    would be 10**10 rank files to list): each present one is checked, then the first
    few absent coordinates are named and the rest counted.
    """
    found = {}
    for name in location.listdir(iteration_dir):
        coordinates = sizes.coordinates_of(name)
        path = posixpath.join(iteration_dir, name, MODEL_FILE)
        if coordinates is not None and location.exists(path):
            found[coordinates] = path
    if len(found) == sizes.ranks:
        return dict(sorted(found.items()))
    absent = itertools.islice((c for c in sizes.coordinates() if c not in found), _LISTED)
    missing = [
        f"{posixpath.join(iteration_dir, sizes.rank_dir(*c), MODEL_FILE)} (TP rank {c[0]}, PP rank {c[1]}, EP rank {c[2]})"
        for c in absent
    ]
    more = sizes.ranks - len(found) - len(missing)
    raise CorruptCheckpointError(
        f"{location.url}: incomplete legacy checkpoint for TP={sizes.tp} x PP={sizes.pp} x EP={sizes.ep}: "
        f"missing {'; '.join(missing)}" + (f" and {more:,} more" if more else "")
    )
