"""``distinct_sorted`` is ``np.unique`` of a key array, whatever the input."""

import numpy as np
import pytest

from hpsray.kernels.distinct import MERGE_MIN, distinct_sorted, in_sorted, is_sorted_distinct


@pytest.mark.parametrize("n,universe", [(0, 10), (1, 10), (2, 1), (1000, 50), (100_000, 2**64 - 1)])
def test_distinct_sorted_equals_np_unique(n, universe):
    keys = np.random.default_rng(n).integers(0, universe, size=n, dtype=np.uint64, endpoint=True)
    got = distinct_sorted(keys)
    np.testing.assert_array_equal(got, np.unique(keys))
    assert got.dtype == np.uint64


def test_distinct_sorted_leaves_its_input_alone():
    keys = np.array([5, 3, 5, 1], dtype=np.uint64)
    keys.setflags(write=False)  # batches from the object store are read-only
    np.testing.assert_array_equal(distinct_sorted(keys), [1, 3, 5])
    np.testing.assert_array_equal(keys, [5, 3, 5, 1])


def test_is_sorted_distinct_only_for_strictly_ascending_keys():
    assert is_sorted_distinct(np.array([], np.uint64)) and is_sorted_distinct(np.array([7], np.uint64))
    assert is_sorted_distinct(np.array([1, 5, 9], np.uint64))
    assert not is_sorted_distinct(np.array([1, 5, 5], np.uint64))
    assert not is_sorted_distinct(np.array([5, 1, 9], np.uint64))


@pytest.mark.parametrize("ascending", [True, False])
@pytest.mark.parametrize("n", [0, 5, MERGE_MIN, 3 * MERGE_MIN + 7])
def test_in_sorted_is_np_isin_merged_or_searched(n, ascending):
    """Ascending keys from MERGE_MIN on take the merge, others the binary search: both are
    ``np.isin``, with repeated values, keys at both ends of uint64 and read-only arrays."""
    rng = np.random.default_rng(n)
    ends = np.array([0, 2**64 - 1], np.uint64)
    keys = np.unique(np.concatenate([rng.integers(0, 2**64 - 1, 2 * n + 3, np.uint64, endpoint=True), ends]))
    drawn = rng.integers(0, 2**64 - 1, n - n // 2, np.uint64, endpoint=True)
    values = np.concatenate([rng.choice(keys, n // 2), drawn])
    values = np.sort(values) if ascending else values
    assert keys.dtype == values.dtype == np.uint64
    for v, k in ((values, keys), (values[: n // 3], keys[::2])):
        v.setflags(write=False)
        k.setflags(write=False)
        np.testing.assert_array_equal(in_sorted(v, k), np.isin(v, k))
    np.testing.assert_array_equal(in_sorted(values, keys[:0]), np.zeros(n, bool))
