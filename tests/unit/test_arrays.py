"""``runtime.arrays``: numpy's results without numpy's slow first-call imports."""

from __future__ import annotations

import numpy as np

from dcp_ext.runtime.arrays import mixed_words, unique


def test_unique_is_numpys():
    rng = np.random.default_rng(11)
    cases = [np.zeros(0, np.int64), np.array([5]), rng.integers(-50, 50, 1000), rng.integers(0, 2**62, (40, 3)),
             np.array([3, 3, 3], np.uint64), np.array([2, 1], np.int32)]
    for values in cases:
        got, want = unique(values), np.unique(values)
        assert got.dtype == want.dtype and np.array_equal(got, want), values


def test_mixed_words_are_fixed_distinct_63_bit_words():
    words = mixed_words(100_000)
    assert words.dtype == np.uint64 and len(words) == 100_000
    assert np.array_equal(words, mixed_words(100_000)) and np.array_equal(words[:10], mixed_words(10))
    assert int(words.max()) < 2**63 and len(np.unique(words)) == len(words)
    assert mixed_words(0).shape == (0,)
