"""Load outputs reuse released memory, never memory a caller still references."""

from __future__ import annotations

import numpy as np

from hpsray.tiers.ssd import SSDPS
from hpsray.tiers.ssd.outbuf import MIN_BYTES, OutputPool


def test_a_buffer_is_reused_only_once_nothing_references_it():
    pool = OutputPool()
    n = MIN_BYTES // 4  # outputs of 4 MiB; half of it still pooled
    a = pool.rows(n, 4)
    addr = a.ctypes.data
    kind = (a.shape, a.dtype, bool(a.flags.c_contiguous), bool(a.flags.writeable))
    del a
    assert kind == ((n, 4), np.float32, True, True)
    b = pool.rows(n // 2, 4)  # released: reused, a smaller output too
    assert b.ctypes.data == addr and b.shape == (n // 2, 4)
    view = b[10:20]
    del b
    c = pool.rows(n // 2, 4)  # a view of it lives: fresh memory, kept instead
    assert c.ctypes.data != addr
    view[:] = 1
    assert not np.shares_memory(view, c)
    del c
    # the kept one is too small: dropped (its memory freed, so the allocator may hand the same
    # address out again), a bigger one allocated and kept
    big = pool.rows(2 * n, 4)
    assert big.shape == (2 * n, 4)
    big_addr = big.ctypes.data
    del big
    assert pool.rows(2 * n, 4).ctypes.data == big_addr  # the bigger one is the one kept
    big = pool.rows(2 * n, 4)
    other = pool.rows(n, 4)  # two outputs held at once never share memory
    assert not np.shares_memory(big, other)
    small = pool.rows(3, 4)  # below MIN_BYTES: allocated as usual
    assert small.shape == (3, 4)
    pool.clear()


def test_loads_into_reused_memory_zero_absent_rows_and_leave_held_outputs_alone(tmp_path):
    w = 64  # outputs of MIN_BYTES and more are pooled
    with SSDPS(tmp_path / "s", w, rows_per_file=1024) as s:
        keys = np.arange(1, 8193, dtype=np.uint64)
        rows = np.repeat(keys[:, None].astype(np.float32), w, axis=1)
        s.dump(keys, rows)
        first, found = s.load(keys)
        assert found.all() and np.array_equal(first, rows)
        kept = first.copy()
        second, _ = s.load(keys[::-1])  # first is held: its memory is not written
        np.testing.assert_array_equal(first, kept)
        np.testing.assert_array_equal(second, rows[::-1])
        addr = second.ctypes.data  # the kept buffer: first was held when second was asked for
        del first, second
        mixed = np.concatenate([keys[:4000], keys[-1] + 1 + keys[:4192]])  # half absent
        got, found = s.load(mixed)  # written into released memory full of rows
        assert got.ctypes.data == addr
        assert found[:4000].all() and not found[4000:].any()
        np.testing.assert_array_equal(got[:4000], rows[:4000])
        assert not got[4000:].any()


def test_loans_fill_reused_memory_equal_to_fresh_copies_and_never_a_held_loans():
    # the load stage's loans (Pulled.load_missing with a pool, as SSDPSShard lends them)
    from hpsray.kernels.init import RowInit
    from hpsray.tiers.loans import Pulled

    w, n = 64, 8192
    rng = np.random.default_rng(0)
    keys = np.arange(1, n + 1, dtype=np.uint64)
    table = rng.standard_normal((n, w)).astype(np.float32)
    pool = OutputPool()

    def pulled(seed: int) -> Pulled:
        shipped = np.random.default_rng(seed).standard_normal((n, w)).astype(np.float32)
        shipped.flags.writeable = False  # as an object-store array arrives
        missing = np.flatnonzero(np.random.default_rng(seed).random(n) < 0.3)
        return Pulled(shipped, missing, keys[missing], RowInit())

    def load(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        found = k % 7 != 0  # some keys never stored: initial rows
        return table[k.astype(np.int64) - 1] * found[:, None], found

    first, loaded = pulled(1).load_missing(load, pool.rows)
    fresh, loaded_fresh = pulled(1).load_missing(load)
    np.testing.assert_array_equal(first, fresh)
    assert loaded == loaded_fresh and first.flags.writeable
    second, _ = pulled(2).load_missing(load, pool.rows)  # first is held: other memory (kept instead)
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, fresh)
    addr = second.ctypes.data
    del first, second, fresh
    third, _ = pulled(3).load_missing(load, pool.rows)  # released: reused, and all of it rewritten
    assert third.ctypes.data == addr
    np.testing.assert_array_equal(third, pulled(3).load_missing(load)[0])
