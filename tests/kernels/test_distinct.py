"""``distinct_sorted`` is ``np.unique`` of a key array, whatever the input."""

import numpy as np
import pytest

from hpsray.kernels.distinct import distinct_sorted, is_sorted_distinct


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
