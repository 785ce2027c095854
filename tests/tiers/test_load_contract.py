"""One ``load`` contract: a row per key (zero where absent) and the found mask, at every layer
that says ``load``; ``SSDPSShard.load_found`` is the one that ships only the found rows."""

import numpy as np

from hpsray.actors.ssdps import SSDPSShard
from hpsray.tiers.ssd import SSDPS


def test_load_gives_a_row_per_key_and_load_found_only_the_found(tmp_path):
    width = 4
    stored = np.array([5, 9, 11], np.uint64)
    rows = np.arange(12, dtype=np.float32).reshape(3, width) + 1
    keys = np.array([9, 7, 5, 3, 11], np.uint64)
    want_found = np.array([True, False, True, False, True])

    store = SSDPS(str(tmp_path / "engine"), width)
    store.dump(stored, rows)
    got, found = store.load(keys)
    assert got.shape == (5, width) and found.tolist() == want_found.tolist()
    np.testing.assert_array_equal(got[~found], 0)
    np.testing.assert_array_equal(got[found], rows[[1, 0, 2]])
    store.close()

    shard = SSDPSShard(0, str(tmp_path / "actor"), width)
    shard.dump(stored, rows)
    some, found = shard.load_found(keys)
    assert found.tolist() == want_found.tolist() and some.shape == (3, width)
    np.testing.assert_array_equal(some, rows[[1, 0, 2]])
    every, found = shard.load_found(stored)
    assert found.all() and np.array_equal(every, rows)
