from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpsray.errors import CapacityError
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.tiers.cache_policy import LruLfuPolicy, belady_hit_rate, unbounded_hit_rate
from hpsray.tiers.mem import MemPS, rows_for_bytes
from hpsray.tiers.ssd import SSDPS

from loading import pull_loaded  # tests/loading.py

W = 5
INIT = RowInit(dim=3, scale=0.1, seed=7, state_value=0.5)


class DictStore:
    """An in-memory stand-in for SSD-PS that records what it was asked."""

    width = W

    def __init__(self) -> None:
        self.rows: dict[int, np.ndarray] = {}
        self.dumped: list[np.ndarray] = []

    def load(self, keys):
        out = np.zeros((keys.size, W), np.float32)
        found = np.array([int(k) in self.rows for k in keys], dtype=bool)
        for i in np.flatnonzero(found):
            out[i] = self.rows[int(keys[i])]
        return out, found

    def dump(self, keys, rows):
        self.dumped.append(keys.copy())
        for k, r in zip(keys.tolist(), rows):
            self.rows[k] = r.copy()


def test_rows_round_trip_through_ssd_with_the_same_values(tmp_path):
    rng = np.random.default_rng(0)
    with SSDPS(tmp_path / "ssd", W, rows_per_file=32) as ssd:
        mem = MemPS(300, W, ssd, INIT)
        ref: dict[int, np.ndarray] = {}
        for b in range(40):
            keys = rng.choice(2000, 200, replace=False).astype(np.uint64)
            rows = pull_loaded(mem, b, keys)
            expect = initial_rows(keys, W, INIT)
            for i, k in enumerate(keys.tolist()):
                if k in ref:
                    expect[i] = ref[k]
            assert np.array_equal(rows, expect), b
            rows = rows * 0.5 + b  # "training"
            mem.write_back(b, keys, rows)
            for k, r in zip(keys.tolist(), rows):
                ref[k] = r
            mem.unpin(b)
        s = mem.stats
        assert s["evicted_dirty"] > 0 and s["loaded"] > 0 and s["initialised"] > 0
        assert s["hits"] + s["misses"] == 40 * 200
        mem.flush()  # everything is now on SSD with its latest value
        keys = np.array(sorted(ref), dtype=np.uint64)
        got, found = ssd.load(keys)
        assert found.all() and np.array_equal(got, np.stack([ref[k] for k in keys.tolist()]))


def test_pinned_rows_are_never_evicted_and_capacity_errors_name_the_numbers():
    store = DictStore()
    mem = MemPS(100, W, store, INIT)
    a = np.arange(0, 40, dtype=np.uint64)
    b = np.arange(40, 80, dtype=np.uint64)
    pull_loaded(mem, "a", a)
    pull_loaded(mem, "b", b)
    mem.write_back("a", a, np.ones((40, W), np.float32))
    c = np.arange(100, 130, dtype=np.uint64)
    with pytest.raises(CapacityError) as e:  # 80 pinned + 30 new > 100
        pull_loaded(mem, "c", c)
    msg = str(e.value)
    assert "capacity 100 rows" in msg and "80 rows are pinned" in msg and "30 not resident" in msg
    assert mem.pinned(a).all() and mem.pinned(b).all() and not mem.contains(c).any()
    assert mem.stats["pinned_rows"] == 80 and mem.in_flight == ["a", "b"]
    mem.unpin("a")
    pull_loaded(mem, "c", c)  # now a's rows go, dirty ones to the store first
    assert mem.pinned(b).all() and mem.pinned(c).all()
    assert mem.contains(a).sum() == 100 - 70
    evicted = np.setdiff1d(a, a[mem.contains(a)])
    assert all(np.array_equal(store.rows[int(k)], np.ones(W, np.float32)) for k in evicted)
    with pytest.raises(CapacityError, match="needs 101 distinct rows"):
        pull_loaded(MemPS(100, W, DictStore()), 0, np.arange(101, dtype=np.uint64))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_batch_cycles_keep_pins_and_values(data):
    """Random interleavings of pull / write_back / unpin with several batches in flight:
    pinned rows stay resident and unchanged by eviction, and every value matches a dict."""
    capacity = data.draw(st.integers(20, 60), label="capacity")
    frac = data.draw(st.sampled_from([0.0, 0.25, 1.0]), label="lru_fraction")
    store = DictStore()
    mem = MemPS(capacity, W, store, INIT, lru_fraction=frac, aging=2.0)
    ref: dict[int, np.ndarray] = {}
    in_flight: dict[int, np.ndarray] = {}

    def expected(keys):
        out = initial_rows(keys, W, INIT)
        for i, k in enumerate(keys.tolist()):
            if k in ref:
                out[i] = ref[k]
        return out

    for step in range(data.draw(st.integers(1, 20), label="steps")):
        op = data.draw(st.sampled_from(["pull", "pull", "write", "unpin"]))
        if op == "pull" and len(in_flight) < 3:
            keys = np.array(data.draw(st.lists(st.integers(0, 80), min_size=1, max_size=25)), dtype=np.uint64)
            must_hold = np.unique(np.concatenate([*in_flight.values(), keys])).size
            if must_hold > capacity:  # exactly when the pinned union cannot fit
                with pytest.raises(CapacityError):
                    pull_loaded(mem, step, keys)
                continue
            rows = pull_loaded(mem, step, keys)
            assert np.array_equal(rows, expected(keys))
            in_flight[step] = keys
        elif op == "write" and in_flight:
            bid = data.draw(st.sampled_from(sorted(in_flight)))
            keys = in_flight[bid]
            rows = np.full((keys.size, W), float(step), np.float32)
            rows[:, 0] = keys
            mem.write_back(bid, keys, rows)
            for k, r in zip(keys.tolist(), rows):
                ref[k] = r
        elif op == "unpin" and in_flight:
            bid = data.draw(st.sampled_from(sorted(in_flight)))
            mem.unpin(bid)
            del in_flight[bid]
        if in_flight:  # invariant 3
            pinned = np.concatenate(list(in_flight.values()))
            assert mem.pinned(pinned).all()
            assert np.array_equal(mem.peek(pinned), expected(pinned))
        assert mem.size <= capacity


def test_a_flush_writes_in_key_order_in_writes_of_bounded_bytes(tmp_path, monkeypatch):
    """However big the cache, one write of a flush carries at most FLUSH_CHUNK_BYTES of rows, in
    key order (what the store writes without a copy), and every row lands."""
    import hpsray.tiers.mem as mem_module

    monkeypatch.setattr(mem_module, "FLUSH_CHUNK_BYTES", 7 * 4 * W)  # seven rows a write
    sizes: list[int] = []
    order: list[np.ndarray] = []

    class Recorded(SSDPS):
        def dump(self, keys, rows):
            sizes.append(int(keys.size))
            order.append(np.asarray(keys).copy())
            super().dump(keys, rows)

    with Recorded(tmp_path / "ssd", W, rows_per_file=16) as ssd:
        mem = MemPS(100, W, ssd, INIT)
        keys = np.random.default_rng(3).permutation(np.arange(1000, 1050, dtype=np.uint64))
        rows = pull_loaded(mem, 0, keys) + 1.0
        mem.write_back(0, keys, rows)
        mem.unpin(0)
        assert mem.flush() == 50
        assert sizes == [7] * 7 + [1]
        written = np.concatenate(order)
        assert np.array_equal(written, np.sort(keys))
        got, found = ssd.load(keys)
        assert found.all() and np.array_equal(got, rows)


def test_only_dirty_rows_are_written_on_eviction():
    store = DictStore()
    mem = MemPS(10, W, store, INIT, lru_fraction=1.0)
    k1 = np.arange(10, dtype=np.uint64)
    pull_loaded(mem, 1, k1)
    mem.write_back(1, k1[:3], np.zeros((3, W), np.float32))
    mem.unpin(1)
    pull_loaded(mem, 2, np.arange(10, 20, dtype=np.uint64))
    mem.unpin(2)
    assert [d.tolist() for d in store.dumped] == [[0, 1, 2]]
    assert mem.stats["evicted"] == 10 and mem.stats["evicted_dirty"] == 3
    rows = pull_loaded(mem, 3, np.array([5, 1], np.uint64))  # clean row re-created, dirty one reloaded
    assert np.array_equal(rows[0], initial_rows(np.array([5], np.uint64), W, INIT)[0])
    assert np.all(rows[1] == 0)
    assert mem.batch_stats(3) == {"hits": 0, "misses": 2, "loaded": 1, "initialised": 1, "hit_rate": 0.0}


def test_lru_alone_evicts_the_least_recent_and_lfu_alone_the_least_frequent():
    lru = MemPS(4, W, DictStore(), lru_fraction=1.0, history=None)
    for b, k in enumerate([[1, 2], [3, 4], [1], [5]]):  # 2 is older than 3, 4
        pull_loaded(lru, b, np.array(k, np.uint64))
        lru.unpin(b)
    assert lru.contains(np.array([1, 2, 3, 4, 5], np.uint64)).tolist() == [True, False, True, True, True]
    lfu = MemPS(4, W, DictStore(), lru_fraction=0.0, aging=None, history=None)
    for b, k in enumerate([[1, 2, 3, 4], [1, 2, 3], [1, 3], [2], [9]]):  # 4 was seen once
        pull_loaded(lfu, b, np.array(k, np.uint64))
        lfu.unpin(b)
    assert lfu.contains(np.array([1, 2, 3, 4, 9], np.uint64)).tolist() == [True, True, True, False, True]


def test_lru_lfu_protects_frequent_rows_from_a_scan():
    mem = MemPS(20, W, DictStore(), lru_fraction=0.25, history=None, aging=None)
    hot = np.arange(10, dtype=np.uint64)
    for b in range(5):
        pull_loaded(mem, b, hot)
        mem.unpin(b)
    for b in range(5, 25):  # a scan of one-off keys, 4 per batch
        pull_loaded(mem, b, np.arange(100 + 4 * b, 104 + 4 * b, dtype=np.uint64))
        mem.unpin(b)
    assert mem.contains(hot).all()  # plain LRU would have lost them all
    s = mem.stats
    assert s["lru_rows"] <= 5 and s["lru_rows"] + s["lfu_rows"] == mem.size == 20


def test_frequency_history_survives_eviction():
    p = LruLfuPolicy(8, lru_fraction=0.0, aging=None, history=4.0)
    k = np.array([42], np.uint64)
    for _ in range(5):
        p.touch(np.array([0]), k)
    p.release(np.array([0]), k)
    p.touch(np.array([3]), k)  # re-admitted: the sketch remembers its visits
    assert p.freq[3] >= 6
    p.release(np.array([3]))  # without its key the count is forgotten
    p.touch(np.array([5]), np.array([43], np.uint64))
    assert p.freq[5] == 1  # a key never evicted starts at 1 (no sketch collision at this size)


def test_write_back_and_unpin_errors_and_stats(tmp_path):
    mem = MemPS(50, W, DictStore(), INIT)
    k = np.array([1, 2, 3, 2], np.uint64)
    rows = pull_loaded(mem, "x", k)
    assert rows.shape == (4, W) and np.array_equal(rows[1], rows[3])
    assert mem.batch_stats("x")["misses"] == 3
    pull_loaded(mem, "x", np.array([3, 4], np.uint64))  # a second pull for the same batch
    assert mem.batch_stats("x") == {"hits": 1, "misses": 4, "loaded": 0, "initialised": 4, "hit_rate": 0.2}
    with pytest.raises(KeyError, match="not pulled by batch 'x'"):
        mem.write_back("x", np.array([1, 99], np.uint64), np.zeros((2, W), np.float32))
    with pytest.raises(KeyError, match="no pinned rows"):
        mem.write_back("nope", np.array([1], np.uint64), np.zeros((1, W), np.float32))
    with pytest.raises(ValueError, match="expected shape"):
        mem.write_back("x", np.array([1], np.uint64), np.zeros((1, W + 1), np.float32))
    mem.unpin("x")
    with pytest.raises(KeyError, match="no pinned rows"):
        mem.unpin("x")
    with pytest.raises(KeyError, match="not resident"):
        mem.peek(np.array([77], np.uint64))
    assert mem.stats["pinned_rows"] == 0 and mem.stats["size"] == 4
    with pytest.raises(ValueError, match="width"):
        MemPS(10, W + 1, DictStore())
    with pytest.raises(ValueError, match="exactly one"):
        MemPS(None, W, DictStore())


def test_capacity_in_bytes():
    n = rows_for_bytes(1 << 20, 32)
    assert 3000 < n < (1 << 20) // 128
    mem = MemPS(None, W, DictStore(), capacity_bytes=1 << 20)
    assert mem.capacity == rows_for_bytes(1 << 20, W)
    with pytest.raises(ValueError, match="holds no row"):
        rows_for_bytes(10, 32)


def test_belady_beats_online_policies_on_a_small_trace():
    rng = np.random.default_rng(5)
    trace = [rng.zipf(1.3, 60).astype(np.uint64) % np.uint64(500) for _ in range(200)]
    opt = belady_hit_rate(trace, 80)["hit_rate"]
    from hpsray.bench.cache import _NullStore

    mem = MemPS(80, 0, _NullStore())
    for t, keys in enumerate(trace):
        pull_loaded(mem, t, keys)
        mem.unpin(t)
    assert 0 < mem.stats["hit_rate"] <= opt + 1e-12


def test_a_cache_that_never_evicts_misses_first_uses_only():
    """Distinct keys per batch; a key hits when an earlier batch named it; ``count_from`` leaves
    the warming batches out of the count."""
    trace = [np.array([1, 1, 2], np.uint64), np.array([2, 3, 3], np.uint64), np.array([4, 1, 3], np.uint64)]
    assert unbounded_hit_rate(trace) == {"hits": 3, "accesses": 7, "hit_rate": 3 / 7}
    assert unbounded_hit_rate(trace, count_from=2) == {"hits": 2, "accesses": 3, "hit_rate": 2 / 3}
    assert unbounded_hit_rate([])["hit_rate"] == 0.0
    # Belady with room for every key is that cache; with less it can only miss more
    assert belady_hit_rate(trace, 4) == unbounded_hit_rate(trace)
    assert belady_hit_rate(trace, 4, count_from=2) == unbounded_hit_rate(trace, count_from=2)
    rng = np.random.default_rng(7)
    zipf = [rng.zipf(1.2, 80).astype(np.uint64) % np.uint64(400) for _ in range(100)]
    assert belady_hit_rate(zipf, 60)["hit_rate"] < unbounded_hit_rate(zipf)["hit_rate"]
    assert belady_hit_rate(zipf, 400) == unbounded_hit_rate(zipf)


def test_a_compact_pull_ships_the_rows_a_full_pull_would_and_never_gathers_held_ones():
    """``pull(..., held, compact=True)`` gives exactly the not-held rows of the full pull, with
    the same missing positions (the load stage fills them), from the same state."""
    rng = np.random.default_rng(5)
    results = []
    for compact in (False, True):
        store = DictStore()
        mem = MemPS(60, W, store, INIT)
        first = np.unique(rng.integers(0, 50, 30, dtype=np.uint64)) if not results else results[0][0]
        rows = pull_loaded(mem, 0, first)
        mem.write_back(0, first, rows + 1.0)
        mem.unpin(0)
        mem.pull(1, first[:5])  # pinned by another batch: resident
        keys = np.unique(np.concatenate([first[::2], np.arange(60, 70, dtype=np.uint64)]))  # 10 not resident
        held = np.isin(keys, first[::4])
        got, missing = mem.pull(2, keys, held, compact=compact)
        results.append((first, keys, held, got, missing))
    (_, keys, held, full, missing), (_, _, _, compact_rows, compact_missing) = results
    np.testing.assert_array_equal(compact_missing, missing)
    assert missing.size == 10 and not held[missing].any()
    assert compact_rows.shape == (int((~held).sum()), W)
    np.testing.assert_array_equal(compact_rows, full[~held])
