"""Load outputs reuse released memory, never memory a caller still references."""

from __future__ import annotations

import numpy as np

from hpsray.tiers.ssd import SSDPS
from hpsray.tiers.ssd.outbuf import KEEP, MIN_BYTES, OutputPool


def test_a_buffer_is_reused_only_once_nothing_references_it():
    pool = OutputPool()
    n = MIN_BYTES // 16
    a = pool.rows(n, 4)
    addr = a.ctypes.data
    b = pool.rows(n, 4)  # a is held: fresh memory
    assert b.ctypes.data != addr
    view = a[10:20]
    del a
    c = pool.rows(n // 2, 4)  # a's view still lives: not reused
    assert c.ctypes.data not in (addr, b.ctypes.data)
    del view, b, c
    d = pool.rows(n, 4)
    assert d.shape == (n, 4) and d.dtype == np.float32 and d.flags.c_contiguous
    e = pool.rows(n, 4)
    assert d.ctypes.data != e.ctypes.data  # two outputs held at once never share memory
    assert len(pool._bufs) == KEEP
    small = pool.rows(3, 4)
    assert small.shape == (3, 4)


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
        addrs = {first.ctypes.data, second.ctypes.data}
        del first, second
        mixed = np.concatenate([keys[:4000], keys[-1] + 1 + keys[:4192]])  # half absent
        got, found = s.load(mixed)  # written into released memory full of rows
        assert got.ctypes.data in addrs
        assert found[:4000].all() and not found[4000:].any()
        np.testing.assert_array_equal(got[:4000], rows[:4000])
        assert not got[4000:].any()
