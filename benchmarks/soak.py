"""Reliability soak: many save/load rounds with kills and corruptions mixed in (not run in CI).

Each iteration saves a fresh random state dict into one directory (over the previous
checkpoint), loads it back with the metadata cache on and checks it bit-exact. Every
``--crash-every`` iterations a save runs in a child process that SIGKILLs itself at a
random phase (``DCP_EXT_CRASH_AT``) or is killed after a random delay; the directory
must then hold the old or the new checkpoint whole and pass ``verify_checkpoint``.
Every ``--corrupt-every`` iterations a copy of the checkpoint gets a random corruption
(from ``tests/reliability/test_corruption.py``) that verification must detect. RSS is
sampled throughout; the run stops at the first failure.

Usage::

    python benchmarks/soak.py --minutes 30           # writes benchmarks/results/soak.json
    python benchmarks/soak.py --iterations 200 --crash-every 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path[:0] = [TESTS, os.path.join(TESTS, "reliability")]
from test_corruption import corrupt, stored_items  # noqa: E402

from dcp_ext import CheckpointError  # noqa: E402
from dcp_ext.runtime.crash import CRASH_ENV  # noqa: E402
from dcp_ext.storage.verify import verify_checkpoint  # noqa: E402
from cli_args import output_file, positive_float, positive_int

from support import assert_state_dict_equal, load, save  # noqa: E402

PHASES = ["before-data", "mid-file", "after-file", "after-data", "before-commit", "after-index", "before-marker", "mid-cleanup"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def random_state(seed: int) -> dict:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    state: dict = {"seed": torch.tensor([seed])}
    for i in range(rng.randrange(4, 40)):
        shape = tuple(rng.randrange(0, 96) for _ in range(rng.randrange(1, 4)))
        dtype = rng.choice(DTYPES)
        value = torch.randn(shape, generator=g) if dtype.is_floating_point else torch.randint(0, 2, shape, generator=g)
        state[f"t{i}"] = value.to(dtype)
    state["extra"] = {"step": seed, "note": "soak"}
    return state


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def _child_save(path: str, seed: int, phase: str | None) -> None:
    if phase:
        os.environ[CRASH_ENV] = phase
    torch.set_num_threads(1)
    save(random_state(seed), path, thread_count=2)


def crash_round(path: str, old_seed: int, new_seed: int, rng: random.Random) -> str:
    """Kill a save of ``new_seed``; return which checkpoint survived ("old"/"new")."""
    phase = rng.choice(PHASES + ["timed"])
    child = mp.get_context("forkserver").Process(target=_child_save, args=(path, new_seed, None if phase == "timed" else phase))
    child.start()
    if phase == "timed":
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(child.pid, signal.SIGKILL)
    child.join()
    report = verify_checkpoint(path)
    if not report.ok:
        raise AssertionError(f"after a kill at {phase}: verify failed: {report.faults}")
    seed = int(load({"seed": torch.tensor([0])}, path, cache_metadata=False)[0]["seed"])
    if seed not in (old_seed, new_seed):
        raise AssertionError(f"after a kill at {phase}: checkpoint of seed {seed}")
    want = random_state(seed)
    assert_state_dict_equal(load(want, path, cache_metadata=False)[0], want)
    return "old" if seed == old_seed else "new"


def corruption_round(path: str, state: dict, rng: random.Random) -> None:
    """Corrupt a copy of the checkpoint of ``state``; verification must catch it."""
    work = Path(tempfile.mkdtemp(prefix="dcp_ext_soak_"))
    try:
        shutil.copytree(path, work, dirs_exist_ok=True)
        items = stored_items(work)
        kinds = ["flip", "truncate", "zero", "delete"] + (["swap"] if len({f for f, *_ in items}) > 1 else [])
        damage = corrupt(work, items, rng, rng.choice(kinds))
        if verify_checkpoint(str(work)).ok:
            raise AssertionError(f"{damage.label}: not detected by verify_checkpoint")
        loaded = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel()} | {"extra.step", "extra.note"}
        if not any(k in loaded for _, k in damage.damaged):
            return  # only records no load reads (empty tensors): verify_checkpoint alone sees them
        try:
            load(state, work, verify_checksums=True, cache_metadata=False)
        except CheckpointException as exc:
            failure = next(iter(exc.failures.values()))[0]
            if not isinstance(failure, CheckpointError):
                raise AssertionError(f"{damage.label}: verified load raised {failure!r}") from exc
            return
        raise AssertionError(f"{damage.label}: verified load did not notice")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=positive_float, default=None, help="stop after this long")
    parser.add_argument("--iterations", type=positive_int, default=None,
                        help="stop after this many (default: 100, or none with --minutes); with --minutes, whichever comes first")
    parser.add_argument("--crash-every", type=positive_int, default=10)
    parser.add_argument("--corrupt-every", type=positive_int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=output_file, default=os.path.join(os.path.dirname(__file__), "results", "soak.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    path = tempfile.mkdtemp(prefix="dcp_ext_soak_ckpt_")
    stop_at = time.time() + args.minutes * 60 if args.minutes else None
    iterations = args.iterations or (None if stop_at else 100)
    figures = {"iterations": 0, "kills": 0, "kills_survived": 0, "survivor": {"old": 0, "new": 0},
               "corruptions": 0, "corruptions_detected": 0, "rss_mib": []}
    seed, started = 0, time.time()
    try:
        while (iterations is None or figures["iterations"] < iterations) and (stop_at is None or time.time() < stop_at):
            seed += 1
            n = figures["iterations"] = figures["iterations"] + 1
            if n % args.crash_every == 0 and seed > 1:
                figures["kills"] += 1
                survivor = crash_round(path, seed - 1, seed, rng)
                figures["kills_survived"] += 1
                figures["survivor"][survivor] += 1
                if survivor == "old":
                    seed += 1
            state = random_state(seed)
            save(state, path, thread_count=2)
            assert_state_dict_equal(load(state, path)[0], state)
            if n % args.corrupt_every == 0:
                figures["corruptions"] += 1
                corruption_round(path, state, rng)
                figures["corruptions_detected"] += 1
            if n % 10 == 0:
                figures["rss_mib"].append(round(rss_mib(), 1))
                print(f"iteration {n}: {figures['kills_survived']} kills survived, "
                      f"{figures['corruptions_detected']} corruptions detected, RSS {figures['rss_mib'][-1]} MiB", flush=True)
    finally:
        figures["seconds"] = round(time.time() - started, 1)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)
        shutil.rmtree(path, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
