"""The distinct-key sketch: accuracy over six orders of magnitude, duplicates, merging."""

import numpy as np
import pytest

from hpsray.plan.sketch import DistinctSketch


@pytest.mark.parametrize("n", [1, 50, 3_000, 40_000, 1_000_000])
def test_count_within_three_standard_errors(n):
    keys = np.random.default_rng(n).integers(0, 2**64 - 2, n, dtype=np.uint64)
    s = DistinctSketch().add(keys).add(keys[::-1])  # duplicates change nothing
    assert abs(s.count() - n) <= max(3 * 1.04 / 128 * n, 1.0)


def test_merge_is_the_union_and_sequential_keys_spread():
    a = np.arange(0, 60_000, dtype=np.uint64)  # consecutive keys: the mixer must spread them
    b = np.arange(30_000, 90_000, dtype=np.uint64)
    sa, sb = DistinctSketch().add(a), DistinctSketch().add(b)
    assert abs(sa.merge(sb).count() - 90_000) < 0.03 * 90_000
    assert abs(sa.count() - 60_000) < 0.03 * 60_000
    assert DistinctSketch().count() == 0.0
    with pytest.raises(ValueError, match="precision"):
        sa.merge(DistinctSketch(p=10))
    with pytest.raises(ValueError, match=r"\[4, 18\]"):
        DistinctSketch(p=30)
