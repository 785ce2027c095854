"""The owner's lending rules (hpsray.tiers.lending) and the borrower's HBM-PS side, without Ray.

The pipeline's BSP exactness rests on them: a loan made while the previous batch trains is stale
exactly where another borrower changed it, and refresh + the borrower's resident rows make every
copy current again.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpsray.kernels.init import RowInit, initial_rows
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.lending import Lender
from hpsray.tiers.loans import Returned
from hpsray.tiers.mem import MemPS
from hpsray.tiers.ssd import SSDPS

from loading import lend  # tests/loading.py

W = 4
INIT = RowInit(dim=W, scale=0.1, seed=3)


@pytest.fixture
def lender(tmp_path):
    store = SSDPS(str(tmp_path / "ssd"), W)
    yield Lender(MemPS(64, W, store, INIT), node=0, init=INIT)
    store.close()


def keys(*values: int) -> np.ndarray:
    return np.array(sorted(values), dtype=np.uint64)


def test_a_loan_is_pinned_until_taken_back_and_the_returned_rows_are_stored(lender):
    k = keys(1, 2, 3)
    rows = lend(lender, 0, k, borrower=1)
    np.testing.assert_array_equal(rows, initial_rows(k, W, INIT))
    assert lender.mem.pinned(k).all()
    assert lender.write_back(0, [Returned(1, k, rows + 1)]) == 3
    assert not lender.mem.pinned(k).any()
    np.testing.assert_array_equal(lender.lookup(k), rows + 1)
    assert lender.hit_rate[0] == 0.0  # a first loan finds nothing resident


def test_stale_keys_are_those_another_borrower_held_in_the_batch_before(lender):
    lend(lender, 0, keys(1, 2, 3), borrower=0)
    lend(lender, 0, keys(3, 4, 5), borrower=1)
    lend(lender, 1, keys(2, 3, 5, 9), borrower=0)  # lent while batch 0 trains
    lend(lender, 1, keys(1, 4, 9), borrower=1)
    # borrower 0 keeps 2, 3 resident from batch 0; 5 was borrower 1's: stale. 9 is new.
    np.testing.assert_array_equal(lender.stale(1, 0), keys(5))
    # borrower 1 keeps 4; 1 was borrower 0's
    np.testing.assert_array_equal(lender.stale(1, 1), keys(1))
    assert lender.stale(0, 0).size == 0  # nothing before the first batch


def test_refresh_sends_the_rows_taken_back_after_the_loan(lender):
    lend(lender, 0, keys(7), borrower=1)
    early = lend(lender, 1, keys(7), borrower=0)  # the pipelined loan of batch 1
    lender.write_back(0, [Returned(1, keys(7), np.full((1, W), 5.0, np.float32))])
    fresh = lender.refresh(1, 0)
    np.testing.assert_array_equal(fresh.keys, keys(7))
    np.testing.assert_array_equal(fresh.rows, np.full((1, W), 5.0, np.float32))
    assert not np.array_equal(early, fresh.rows)
    lender.write_back(1, [Returned(0, keys(7), fresh.rows)])
    assert list(lender.lent) == [(1, 0)]  # batch 0's leases are forgotten once batch 1 is back


def test_a_pipelined_two_borrower_schedule_ends_with_the_sequential_values(lender):
    """Two borrowers, each batch lent before the previous one is taken back; every copy gets
    the same combined update (BSP). The owner must end with the values of a plain sequential run."""
    rng = np.random.default_rng(0)
    universe = np.arange(1, 40, dtype=np.uint64)
    batches = [[np.unique(rng.choice(universe, 12)) for _ in range(2)] for _ in range(8)]
    expected = {int(k): r for k, r in zip(universe, initial_rows(universe, W, INIT))}
    hbms = [HbmPS(128, W, INIT) for _ in range(2)]

    def lend_both(t: int) -> list[np.ndarray]:
        return [lend(lender, t, batches[t][b], borrower=b) for b in range(2)]

    loans = lend_both(0)
    for t, parts in enumerate(batches):
        if t > 0:  # refresh after the previous take-back, as the pipeline submits it
            for b in range(2):
                fresh = lender.refresh(t, b)
                hbms[b].borrow(parts[b], loans[b], [(fresh.keys, fresh.rows)])
        else:
            for b in range(2):
                hbms[b].borrow(parts[b], loans[b])
        # the combined update of this batch: +1 per borrower that touched the key
        touched = np.concatenate(parts)
        keys_all, counts = np.unique(touched, return_counts=True)
        for k, c in zip(keys_all.tolist(), counts):
            expected[k] = expected[k] + c
        for b in range(2):
            add = counts[np.searchsorted(keys_all, parts[b])].astype(np.float32)
            hbms[b].insert_or_assign(parts[b], hbms[b].get(parts[b]) + add[:, None])
        if t + 1 < len(batches):
            loans = lend_both(t + 1)  # overlaps batch t's training
        lender.write_back(t, [Returned(b, parts[b], hbms[b].get(parts[b])) for b in range(2)])
    got = lender.lookup(universe)
    np.testing.assert_allclose(got, np.stack([expected[int(k)] for k in universe]), rtol=0, atol=1e-5)


def test_borrow_keeps_resident_rows_and_drops_what_the_batch_does_not_need():
    hbm = HbmPS(64, W, INIT)
    hbm.borrow(keys(1, 2), np.ones((2, W), np.float32))
    hbm.insert_or_assign(keys(2), np.full((1, W), 7.0, np.float32))  # trained in batch 0
    hbm.borrow(keys(2, 3), np.zeros((2, W), np.float32), [(keys(3), np.full((1, W), 9.0, np.float32))])
    assert hbm.size == 2
    np.testing.assert_array_equal(hbm.get(keys(2, 3)), np.array([[7.0] * W, [9.0] * W], np.float32))
