"""The numba CPU hash table against a dict model, operation by operation."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hpsray.errors import TableFullError
from hpsray.kernels.cpu import CpuHashTable
from hpsray.kernels.hashing import EMPTY_KEY
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.kernels.optim import SGD, Adagrad, Adam, apply_to_rows

INIT = RowInit(dim=3, scale=0.5, seed=11, state_value=0.25)
WIDTH = 5


def u64(xs):
    return np.asarray(xs, dtype=np.uint64)


def test_find_or_insert_gives_stable_slots_and_initial_rows():
    t = CpuHashTable(100, WIDTH, INIT)
    keys = u64([10, 20, 10, 30, 20])
    slots = t.find_or_insert(keys)
    assert slots[0] == slots[2] and slots[1] == slots[4]
    assert len(set(slots.tolist())) == 3 and t.size == 3
    np.testing.assert_array_equal(t.find(keys), slots)
    np.testing.assert_array_equal(t.gather(slots), initial_rows(keys, WIDTH, INIT))
    np.testing.assert_array_equal(t.find(u64([40])), [-1])
    assert t.load_factor == pytest.approx(0.03)


def test_initial_rows_depend_only_on_the_key():
    a, b = CpuHashTable(50, WIDTH, INIT), CpuHashTable(5000, WIDTH, INIT)
    b.find_or_insert(np.arange(1000, 1100, dtype=np.uint64))  # different slots, other keys first
    keys = u64([7, 99, 123456789])
    np.testing.assert_array_equal(a.gather(a.find_or_insert(keys)), b.gather(b.find_or_insert(keys)))
    other_seed = CpuHashTable(50, WIDTH, RowInit(dim=3, scale=0.5, seed=12, state_value=0.25))
    assert not np.array_equal(a.get(keys), other_seed.gather(other_seed.find_or_insert(keys)))


def test_gather_of_absent_slot_is_an_error():
    t = CpuHashTable(10, WIDTH, INIT)
    with pytest.raises(KeyError, match="slot -1"):
        t.gather(t.find(u64([1])))


def test_put_writes_the_rows_gather_reads_and_refuses_absent_slots():
    t = CpuHashTable(64, WIDTH, INIT)
    keys = u64(range(1, 31))
    slots = t.find_or_insert(keys, initialise=False)
    values = np.arange(30 * WIDTH, dtype=np.float32).reshape(30, WIDTH)
    t.put(slots, values)
    np.testing.assert_array_equal(t.get(keys), values)
    np.testing.assert_array_equal(t.gather(slots[::-1]), values[::-1])
    with pytest.raises(KeyError, match="put: slot -1"):
        t.put(np.concatenate([slots[:2], t.find(u64([99]))]), np.zeros((3, WIDTH), np.float32))
    np.testing.assert_array_equal(t.get(keys), values)  # a refused call changed nothing


def test_scatter_add_sums_duplicates_and_requires_present_keys():
    t = CpuHashTable(16, 2)
    t.find_or_insert(u64([1, 2]))
    t.scatter_add(u64([1, 2, 1, 1]), np.array([[1, 2], [3, 4], [5, 6], [7, 8]], np.float32))
    np.testing.assert_array_equal(t.get(u64([1, 2])), [[13, 16], [3, 4]])
    with pytest.raises(KeyError, match="1 of 2 keys are not in the table"):
        t.scatter_add(u64([1, 3]), np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(t.get(u64([1])), [[13, 16]])  # a failed call changed nothing


def test_assign_upserts_and_last_duplicate_wins():
    t = CpuHashTable(16, 2)
    t.insert_or_assign(u64([5, 6, 5]), np.array([[1, 1], [2, 2], [3, 3]], np.float32))
    np.testing.assert_array_equal(t.get(u64([5, 6])), [[3, 3], [2, 2]])
    with pytest.raises(ValueError, match=r"expected shape \(1, 2\)"):
        t.insert_or_assign(u64([5]), np.ones((1, 3), np.float32))


def test_erase_then_reinsert_reuses_the_row_and_reinitialises_it():
    t = CpuHashTable(4, WIDTH, INIT)
    keys = u64([1, 2, 3, 4])
    t.find_or_insert(keys)
    t.scatter_add(u64([2]), np.ones((1, WIDTH), np.float32))
    assert t.erase(u64([2, 2, 99])) == 1
    assert t.size == 3
    np.testing.assert_array_equal(t.find(keys) >= 0, [True, False, True, True])
    t.find_or_insert(u64([2]))  # fits again: the erased row is free
    np.testing.assert_array_equal(t.get(u64([2])), initial_rows(u64([2]), WIDTH, INIT))


def test_erase_keeps_colliding_keys_findable():
    # A tiny table forces long probe chains; erasing from their middle must not break them.
    t = CpuHashTable(12, 1)
    keys = np.arange(1, 13, dtype=np.uint64)
    t.insert_or_assign(keys, keys.astype(np.float32)[:, None])
    rng = np.random.default_rng(0)
    alive = set(keys.tolist())
    for k in rng.permutation(keys):
        t.erase(u64([k]))
        alive.discard(int(k))
        rest = u64(sorted(alive))
        if rest.size:
            np.testing.assert_array_equal(t.get(rest)[:, 0], rest.astype(np.float32))


def test_full_table_raises_and_changes_nothing():
    t = CpuHashTable(3, 1)
    t.insert_or_assign(u64([1, 2]), np.array([[1], [2]], np.float32))
    with pytest.raises(TableFullError, match="capacity 3 rows, 2 used, this call needs 2 more"):
        t.find_or_insert(u64([1, 3, 4, 3]))
    assert t.size == 2
    np.testing.assert_array_equal(t.find(u64([3, 4])), [-1, -1])
    np.testing.assert_array_equal(t.get(u64([1, 2]))[:, 0], [1, 2])
    slots_before = t.find_or_insert(u64([3]))  # a failed insert leaves slot allocation as it was
    fresh = CpuHashTable(3, 1)
    fresh.insert_or_assign(u64([1, 2]), np.array([[1], [2]], np.float32))
    np.testing.assert_array_equal(slots_before, fresh.find_or_insert(u64([3])))
    assert t.size == 3 and t.load_factor == 1.0


def test_bad_keys_are_refused_clearly():
    t = CpuHashTable(4, 1)
    with pytest.raises(ValueError, match="reserved as the empty marker"):
        t.find_or_insert(np.array([EMPTY_KEY], dtype=np.uint64))
    with pytest.raises(TypeError, match="integer keys"):
        t.find(np.array([1.5]))
    with pytest.raises(ValueError, match="negative key"):
        t.find(np.array([-1]))
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        CpuHashTable(0, 1)


def test_export_lists_every_key_once():
    t = CpuHashTable(1000, 2)
    keys = np.random.default_rng(1).choice(10**12, 600, replace=False).astype(np.uint64)
    t.insert_or_assign(keys, np.stack([keys % 7, keys % 11], 1).astype(np.float32))
    t.erase(keys[:100])
    k, r = t.export()
    assert sorted(k.tolist()) == sorted(keys[100:].tolist())
    np.testing.assert_array_equal(t.keys(), k)
    np.testing.assert_array_equal(r, np.stack([k % 7, k % 11], 1).astype(np.float32))


@pytest.mark.parametrize("opt", [SGD(lr=0.1), Adagrad(lr=0.1), Adagrad(lr=0.1, per_row=True), Adam(lr=0.1)])
def test_apply_gradients_sums_duplicates_then_updates_once(opt):
    dim = 3
    init = RowInit.for_optimizer(dim, opt, scale=0.3, seed=5)
    width = dim + opt.state_width(dim)
    t = CpuHashTable(64, width, init)
    keys = u64([4, 9, 4, 4, 17])
    t.find_or_insert(keys)
    g = np.random.default_rng(2).standard_normal((5, dim)).astype(np.float32)
    t.apply_gradients(keys, g, opt, step=1)
    # expected: one update per distinct key with its summed gradient, by the shared math
    uniq = u64([4, 9, 17])
    summed = np.stack([g[[0, 2, 3]].sum(0), g[1], g[4]]).astype(np.float32)
    rows = initial_rows(uniq, width, init)
    apply_to_rows(rows, summed, opt, step=1)
    np.testing.assert_allclose(t.get(uniq), rows, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", [SGD(lr=0.1), Adagrad(lr=0.1), Adam(lr=0.1)])
def test_sorted_distinct_keys_update_exactly_like_any_order(opt):
    """Sorted distinct keys (a mini-batch's) take the no-duplicates path; the rows must come
    out bit-equal to the same update given in another order."""
    dim = 4
    init = RowInit.for_optimizer(dim, opt, scale=0.3, seed=5)
    width = dim + opt.state_width(dim)
    keys = np.sort(np.random.default_rng(3).choice(10**9, 500, replace=False).astype(np.uint64))
    g = np.random.default_rng(4).standard_normal((500, dim)).astype(np.float32)
    fast, general = CpuHashTable(1024, width, init), CpuHashTable(1024, width, init)
    fast.find_or_insert(keys)
    general.find_or_insert(keys)
    order = np.random.default_rng(5).permutation(500)
    for step in (1, 2):
        fast.apply_gradients(keys, g * step, opt, step=step)
        general.apply_gradients(keys[order], g[order] * step, opt, step=step)
    np.testing.assert_array_equal(fast.get(keys), general.get(keys))


def test_apply_gradients_refuses_a_mismatched_optimizer():
    t = CpuHashTable(8, 3, RowInit(dim=3))
    t.find_or_insert(u64([1]))
    with pytest.raises(ValueError, match="needs rows of width 6"):
        t.apply_gradients(u64([1]), np.zeros((1, 3), np.float32), Adagrad(), 1)


class TableVersusDict(RuleBasedStateMachine):
    """Random operation sequences: the table must always equal a dict of rows."""

    CAP = 24
    keys_st = st.lists(st.integers(0, 60), min_size=0, max_size=12).map(u64)

    def __init__(self):
        super().__init__()
        self.t = CpuHashTable(self.CAP, 2, RowInit(dim=2, scale=1.0, seed=3))
        self.model: dict[int, np.ndarray] = {}

    def _fresh(self, k):
        return initial_rows(u64([k]), 2, self.t.init)[0]

    @rule(keys=keys_st)
    def find_or_insert(self, keys):
        new = set(keys.tolist()) - set(self.model)
        if len(self.model) + len(new) > self.CAP:
            with pytest.raises(TableFullError):
                self.t.find_or_insert(keys)
            return
        slots = self.t.find_or_insert(keys)
        for k in new:
            self.model[k] = self._fresh(k)
        for k, s in zip(keys.tolist(), slots.tolist()):
            assert s == self.t.find(u64([k]))[0]

    @rule(keys=keys_st)
    def find(self, keys):
        found = self.t.find(keys) >= 0
        assert found.tolist() == [k in self.model for k in keys.tolist()]

    @rule(keys=keys_st)
    def erase(self, keys):
        n = self.t.erase(keys)
        present = set(keys.tolist()) & set(self.model)
        assert n == len(present)
        for k in present:
            del self.model[k]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def scatter_add(self, data):
        keys = u64(data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=8)))
        vals = np.arange(keys.size * 2, dtype=np.float32).reshape(-1, 2)
        self.t.scatter_add(keys, vals)
        for k, v in zip(keys.tolist(), vals):
            self.model[k] = (self.model[k] + v).astype(np.float32)

    @rule(keys=keys_st)
    def assign(self, keys):
        if len(self.model) + len(set(keys.tolist()) - set(self.model)) > self.CAP:
            return
        vals = np.arange(keys.size * 2, dtype=np.float32).reshape(-1, 2) + 0.5
        self.t.insert_or_assign(keys, vals)
        for k, v in zip(keys.tolist(), vals):
            self.model[k] = v

    @invariant()
    def same_contents(self):
        assert self.t.size == len(self.model)
        k, r = self.t.export()
        got = {int(a): b for a, b in zip(k, r)}
        assert got.keys() == self.model.keys()
        for key, row in self.model.items():
            np.testing.assert_allclose(got[key], row, rtol=1e-6)


TableVersusDict.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_table_matches_dict_model = TableVersusDict.TestCase


def test_assign_writes_present_keys_only_and_put_writes_by_slot():
    t = CpuHashTable(100, WIDTH, INIT)
    keys = u64([10, 20, 30])
    slots = t.find_or_insert(keys)
    rows = np.arange(15, dtype=np.float32).reshape(3, WIDTH)
    t.assign(u64([10, 30, 10]), np.stack([rows[0], rows[2], rows[1]]))  # the last duplicate wins
    np.testing.assert_array_equal(t.get(u64([10, 30])), np.stack([rows[1], rows[2]]))
    before = t.export()
    with pytest.raises(KeyError, match="assign: 1 of 2 keys are not in the table"):
        t.assign(u64([20, 40]), rows[:2])
    np.testing.assert_array_equal(t.export()[1], before[1])  # nothing written
    assert t.size == 3
    t.put(slots[::-1], rows)
    np.testing.assert_array_equal(t.gather(slots[::-1]), rows)
    with pytest.raises(KeyError, match="put: slot -1"):
        t.put(np.array([-1], np.int64), rows[:1])
    t.insert_or_assign(u64([40]), rows[:1])  # inserts
    np.testing.assert_array_equal(t.get(u64([40])), rows[:1])
