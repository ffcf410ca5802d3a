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
from argparse import Namespace
from dataclasses import dataclass

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.storage.location import Location

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
RELEASE = "release"
_ITER_DIR = re.compile(r"^iter_\d{7}$")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


@dataclass(frozen=True)
class Parallelism:
    tp: int
    pp: int
    ep: int

    def coordinates(self) -> list[tuple[int, int, int]]:
        return list(itertools.product(range(self.tp), range(self.pp), range(self.ep)))

    def rank_dir(self, tp: int, pp: int, ep: int) -> str:
        return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if self.pp > 1 else "") + (f"_{ep:03d}" if self.ep > 1 else "")


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
            if text != RELEASE and not text.isdigit():
                raise CorruptCheckpointError(f"{location.url}/{TRACKER}: expected an iteration number or 'release', found {text!r}")
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


def first_rank_file(location: Location, iteration_dir: str) -> str:
    """The TP0/PP0/EP0 file: the lexically first ``mp_rank_*`` directory."""
    ranks = sorted(n for n in location.listdir(iteration_dir) if _RANK_DIR.match(n))
    if not ranks:
        raise CheckpointError(f"{location.url}/{iteration_dir}: no mp_rank_* directories")
    return posixpath.join(iteration_dir, ranks[0], MODEL_FILE)


def parallelism(location: Location, iteration_dir: str, args: Namespace | None) -> Parallelism:
    """TP/PP/EP sizes from ``args``, else from the directory names."""
    if args is not None and getattr(args, "tensor_model_parallel_size", None):
        return Parallelism(
            int(args.tensor_model_parallel_size),
            int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
            int(getattr(args, "expert_model_parallel_size", 1) or 1),
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
    """Every (tp, pp, ep) -> file; raises naming the coordinates of any that is missing."""
    present = set(location.listdir(iteration_dir))
    files, missing = {}, []
    for tp, pp, ep in sizes.coordinates():
        directory = sizes.rank_dir(tp, pp, ep)
        path = posixpath.join(iteration_dir, directory, MODEL_FILE)
        if directory not in present or not location.exists(path):
            missing.append(f"{path} (TP rank {tp}, PP rank {pp}, EP rank {ep})")
        files[(tp, pp, ep)] = path
    if missing:
        raise CheckpointError(
            f"{location.url}: incomplete legacy checkpoint for TP={sizes.tp} x PP={sizes.pp} x EP={sizes.ep}: "
            f"missing {'; '.join(missing)}"
        )
    return files
