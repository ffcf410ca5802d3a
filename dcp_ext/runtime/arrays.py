"""numpy operations without numpy's slow first-call imports.

A fresh process's first save ran ``np.unique`` (which imports ``numpy.ma`` on its first
call: 7-11 ms) and ``np.random.default_rng`` (``numpy.random``: 11-13 ms) in its global
plan; a training job's first checkpoint paid both. These give the same arrays from
operations numpy has loaded already.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's constants
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)``: the distinct values, ascending, flattened."""
    ordered = np.sort(values, axis=None)
    distinct = np.empty(len(ordered), bool)
    distinct[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=distinct[1:])
    return ordered[distinct]


def mixed_words(count: int) -> np.ndarray:
    """``count`` well-mixed 63-bit words (uint64), the same in every process: splitmix64
    of 1..count (its multiplications wrap modulo 2**64, as uint64 arrays do)."""
    words = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
    words ^= words >> np.uint64(30)
    words *= _MIX1
    words ^= words >> np.uint64(27)
    words *= _MIX2
    words ^= words >> np.uint64(31)
    return words >> np.uint64(1)
