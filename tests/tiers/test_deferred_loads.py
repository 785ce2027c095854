"""Loads as their own stage, without Ray: MEM-PS reserves the rows it does not hold
(``MemPS.pull``, ``Lender.pull``) and the load stage fills them from a store that
writes behind (dumps and deletes still in flight when they return). The pipelined schedule must
still end with the values of a plain sequential run (docs/architecture.md: invariants 2 to 4).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpsray.kernels.init import RowInit, initial_rows
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.lending import Lender
from hpsray.tiers.loans import Returned
from hpsray.tiers.mem import MemPS

from loading import fill  # tests/loading.py

W = 4
INIT = RowInit(dim=W, scale=0.1, seed=3)


class LaggingStore:
    """A store whose dumps and deletes take effect only when :meth:`settle` says so; until then
    :meth:`stage_load` (the load stage's, another caller's, which may overtake them) does not
    see them; ``in_flight`` and MEM-PS's own ``load`` (ordered after its dumps) do."""

    width = W

    def __init__(self) -> None:
        self.rows: dict[int, np.ndarray] = {}
        self.queue: list[tuple[np.ndarray, np.ndarray | None]] = []  # oldest first
        self.loads = 0

    def load(self, keys):
        rows, found = self.stage_load(keys)
        got, flying, deleted = self.in_flight(keys)
        rows[flying] = got[flying]
        return rows, (found | flying) & ~deleted

    def stage_load(self, keys):
        self.loads += int(keys.size)
        out = np.zeros((keys.size, W), np.float32)
        found = np.array([int(k) in self.rows for k in keys], dtype=bool)
        for i in np.flatnonzero(found):
            out[i] = self.rows[int(keys[i])]
        return out, found

    def dump(self, keys, rows):
        self.queue.append((keys.copy(), rows.copy()))

    def delete(self, keys):
        self.queue.append((keys.copy(), None))
        return 0

    def in_flight(self, keys):
        rows = np.zeros((keys.size, W), np.float32)
        found = np.zeros(keys.size, bool)
        deleted = np.zeros(keys.size, bool)
        seen = np.zeros(keys.size, bool)
        for op_keys, op_rows in reversed(self.queue):  # the newest op of a key wins
            hit = np.isin(keys, op_keys) & ~seen
            for i in np.flatnonzero(hit):
                if op_rows is None:
                    deleted[i] = True
                else:
                    found[i] = True
                    rows[i] = op_rows[np.flatnonzero(op_keys == keys[i])[-1]]
            seen |= hit
        return rows, found, deleted

    def settle(self, n: int | None = None) -> None:
        """Apply the ``n`` oldest ops (all when ``None``), in order."""
        n = len(self.queue) if n is None else min(n, len(self.queue))
        for op_keys, op_rows in self.queue[:n]:
            for i, k in enumerate(op_keys.tolist()):
                if op_rows is None:
                    self.rows.pop(k, None)
                else:
                    self.rows[k] = op_rows[i].copy()
        del self.queue[:n]


def keys(*values: int) -> np.ndarray:
    return np.array(sorted(values), dtype=np.uint64)


def test_reserved_rows_are_pinned_missing_again_and_never_read_as_values():
    store = LaggingStore()
    mem = MemPS(16, W, store, INIT)
    rows, missing = mem.pull("a", keys(1, 2, 3))
    assert missing.tolist() == [0, 1, 2] and not rows.any()
    assert mem.pinned(keys(1, 2, 3)).all() and not mem.has_rows(keys(1, 2, 3)).any()
    with pytest.raises(KeyError, match="reserved for a load"):
        mem.peek(keys(2))
    _, again = mem.pull("b", keys(2, 4))  # another lease of the same rows: loaded again
    assert again.tolist() == [0, 1]
    assert mem.flush() == 0 and not store.queue  # a reserved row is never dumped
    assert fill(mem, keys(1, 2, 3), np.ones((3, W), np.float32)) == 3
    np.testing.assert_array_equal(mem.peek(keys(2)), np.ones((1, W), np.float32))
    assert mem.stats["reserved_rows"] == 1  # key 4
    with pytest.raises(ValueError, match="sorted and distinct"):
        mem.pull("c", np.array([3, 1], np.uint64))


def test_rows_whose_dump_is_in_flight_are_served_from_it_not_named_missing():
    store = LaggingStore()
    mem = MemPS(4, W, store, INIT)
    a = keys(1, 2, 3, 4)
    mem.pull(0, a)
    mem.write_back(0, a, np.full((4, W), 2.0, np.float32))
    mem.unpin(0)
    mem.pull(1, keys(5, 6, 7, 8))  # evicts batch 0's dirty rows: their dump is in flight
    mem.unpin(1)
    assert store.queue and not store.rows
    rows, missing = mem.pull(2, keys(1, 9))
    assert missing.tolist() == [1]  # 1 is in flight: a hit, from the store's rows in flight
    np.testing.assert_array_equal(rows[0], np.full(W, 2.0, np.float32))
    assert mem.stats["recovered"] == 1
    store.delete(keys(2))  # an expiry delete in flight: the key starts again from its initial row
    mem.unpin(2)
    rows, missing = mem.pull(3, keys(2))
    assert missing.size == 0
    np.testing.assert_array_equal(rows, initial_rows(keys(2), W, INIT))


@pytest.mark.parametrize("capacity,settle_every", [(64, 1), (20, 1), (20, 3), (22, 0)])
def test_a_pipelined_schedule_with_late_loads_and_lagging_dumps_ends_with_the_sequential_values(capacity, settle_every):
    """Two borrowers; batch ``t+1`` is lent while ``t`` trains and *loaded after* ``t`` is taken
    back (the load stage runs beside MEM-PS); dumps take effect late or (0) only at the end."""
    rng = np.random.default_rng(capacity + settle_every)
    store = LaggingStore()
    lender = Lender(MemPS(capacity, W, store, INIT), node=0, init=INIT)
    universe = np.arange(1, 30, dtype=np.uint64)
    batches = [[np.unique(rng.choice(universe, 5)) for _ in range(2)] for _ in range(14)]
    expected = {int(k): r for k, r in zip(universe, initial_rows(universe, W, INIT))}
    hbms = [HbmPS(128, W, INIT) for _ in range(2)]

    def settle() -> None:
        if settle_every:
            store.settle(int(rng.integers(0, settle_every + 1)))

    pulled = [lender.pull(0, batches[0][b], borrower=b) for b in range(2)]
    for t, parts in enumerate(batches):
        loans = [p.load_missing(store.stage_load)[0] for p in pulled]  # the load stage of batch t
        settle()
        for b in range(2):
            fresh = lender.refresh(t, b) if t > 0 else None
            hbms[b].borrow(parts[b], loans[b], [(fresh.keys, fresh.rows)] if fresh is not None else [])
        touched = np.concatenate(parts)
        keys_all, counts = np.unique(touched, return_counts=True)
        for k, c in zip(keys_all.tolist(), counts):
            expected[k] = expected[k] + c
        for b in range(2):
            add = counts[np.searchsorted(keys_all, parts[b])].astype(np.float32)
            hbms[b].insert_or_assign(parts[b], hbms[b].get(parts[b]) + add[:, None])
        if t + 1 < len(batches):
            pulled = [lender.pull(t + 1, batches[t + 1][b], borrower=b) for b in range(2)]
        settle()
        lender.write_back(t, [Returned(b, parts[b], hbms[b].get(parts[b])) for b in range(2)])
    assert lender.mem.stats["evicted_dirty"] > 0 or capacity == 64
    got = lender.lookup(universe)  # from MEM-PS, the rows in flight, the store
    want = np.stack([expected[int(k)] for k in universe])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    lender.mem.flush()
    store.settle()
    stored, found = store.stage_load(universe)
    np.testing.assert_allclose(stored[found], want[found], rtol=0, atol=1e-5)
