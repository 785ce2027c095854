"""The Ray-free side of the relaxed modes (:mod:`hpsray.cluster.updates`): merged payloads, the
version book of a mailbox, and what a trainer replays at a batch start."""

from types import SimpleNamespace

import numpy as np

from hpsray.cluster.updates import CarryOver, Versions, crosses_batches, merge_payloads, payload_bytes


def _u64(*keys: int) -> np.ndarray:
    return np.array(keys, np.uint64)


def test_a_merged_payload_sums_rows_by_key_and_dense_in_order():
    a = (_u64(5, 1), np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.array([1.0], np.float32))
    b = (_u64(1, 9), np.array([[10.0, 20.0], [5.0, 6.0]], np.float32), np.array([2.0], np.float32))
    empty = (np.empty(0, np.uint64), np.empty((0, 2), np.float32), None)
    keys, grads, dense = merge_payloads([a, empty, b])
    assert keys is not None and grads is not None and dense is not None
    np.testing.assert_array_equal(keys, _u64(1, 5, 9))
    np.testing.assert_array_equal(grads, [[13.0, 24.0], [1.0, 2.0], [5.0, 6.0]])
    np.testing.assert_array_equal(dense, [3.0])
    assert payload_bytes((keys, grads, dense)) == 3 * 8 + 6 * 4 + 4


def test_dense_only_payloads_merge_to_their_sum():
    parts = [(None, None, np.array([1.0, 2.0], np.float32)), (None, None, np.array([3.0, 4.0], np.float32))]
    keys, grads, dense = merge_payloads(parts)
    assert keys is None and grads is None
    np.testing.assert_array_equal(dense, [4.0, 6.0])
    assert parts[0][2] is not None and parts[0][2][0] == 1.0  # the parts are left as they were


def test_versions_hand_each_consumer_what_it_has_not_taken_and_forget_what_all_took():
    v = Versions(world=3)
    for clock in (1, 2, 3):
        v.put("all", 0, clock, [f"ref{clock}"])
    assert v.newest("all", 0) == 3 and v.newest("all", 1) == 0 and v.newest("dense", 0) == 0
    assert v.take("all", 1, 0, upto=2) == [(0, 1, ["ref1"]), (0, 2, ["ref2"])]
    assert v.take("all", 1, 0, upto=None) == [(0, 3, ["ref3"])]
    assert v.take("all", 1, 0, upto=None) == []
    v.forget(lambda producer: [1, 2])  # consumer 2 took nothing yet
    assert len(v.updates) == 3
    assert v.take("all", 2, 0, upto=1) == [(0, 1, ["ref1"])]
    v.forget(lambda producer: [1, 2])
    assert sorted(v.updates) == [("all", 0, 2), ("all", 0, 3)]


def test_carry_over_replays_the_logged_updates_on_rows_borrowed_anew_only():
    carry = CarryOver()
    carry.batch_end(4, resident=_u64(1, 2))  # rows 1 and 2 held at the end of the first batch
    carry.record(3, _u64(2, 3), np.array([[1.0], [2.0]], np.float32))
    carry.record(5, _u64(3, 4), np.array([[4.0], [8.0]], np.float32))
    carry.record(6, None, np.empty((0, 1), np.float32))  # nothing to log
    keys, grads = carry.replay(_u64(2, 3, 4))  # 3 and 4 are new, 2 was held
    np.testing.assert_array_equal(keys, _u64(3, 3, 4))
    np.testing.assert_array_equal(grads, [[2.0], [4.0], [8.0]])
    assert carry.base == 4 and [u[0] for u in carry.log] == [5]  # clock 3 is no longer needed
    carry.settled(9, _u64(7))
    keys, grads = carry.replay(_u64(8))
    assert keys.size == 0 and grads.shape == (0, 0) and carry.first == 10


def test_only_ssp_and_asp_cross_batch_ends():
    assert [crosses_batches(SimpleNamespace(consistency=m)) for m in ("bsp", "ssp", "absp", "asp")] == [
        False,
        True,
        False,
        True,
    ]
    assert not crosses_batches(None)
