"""SSD-PS layout: compaction places the rows loads want most together (load heat), a relayout
changes placement only, and loads count the pages they read."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from hpsray.bench import BENCHMARKS, layout
from hpsray.kernels.hashing import mix64_array
from hpsray.tiers.ssd import SSDPS
from hpsray.tiers.ssd.heat import AGE_EVERY, LoadHeat
from hpsray.tiers.ssd.paramfile import HEADER_BYTES


def _store(tmp_path, heat_counters: int = 1 << 14) -> tuple[SSDPS, np.ndarray, np.ndarray]:
    s = SSDPS(tmp_path / "ssd", 4, rows_per_file=1000, background=False, heat_counters=heat_counters)
    keys = np.sort(mix64_array(np.arange(5000, dtype=np.uint64)))  # hashes: hot keys spread over the files
    rows = np.arange(keys.size * 4, dtype=np.float32).reshape(-1, 4)
    s.dump(keys, rows)
    return s, keys, rows


def _where(s: SSDPS, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """File numbers and row positions of ``keys``."""
    with s.state.lock:
        slots, pos = s.state.keys.locate(keys)
        return s.state.files.no[slots], pos


def test_relayout_writes_the_most_loaded_rows_first_and_together(tmp_path):
    s, keys, rows = _store(tmp_path)
    hot, warm = keys[::50], keys[25::50]  # 100 rows loaded 3 times, 100 once, the rest never
    for _ in range(3):
        s.load(hot)
    s.load(warm)
    before_files = {int(n) for n in _where(s, hot)[0]}
    assert len(before_files) == 5  # spread over every file
    assert s.relayout() == 5
    files, pos = _where(s, hot)
    assert np.unique(files).size == 1 and sorted(pos.tolist()) == list(range(100))  # first, together
    files_w, pos_w = _where(s, warm)
    assert (files_w == files[0]).all() and sorted(pos_w.tolist()) == list(range(100, 200))  # next
    got, found = s.load(keys)  # placement only: every row as it was
    assert found.all() and np.array_equal(got, rows)
    assert s.verify() == 5  # every file checks out
    s.close()
    again = SSDPS(tmp_path / "ssd")  # and as it was after a reopen
    got, found = again.load(keys)
    assert found.all() and np.array_equal(got, rows)
    again.close()


def test_a_relayout_leaves_tombstones_alone_and_deleted_keys_deleted(tmp_path):
    s, keys, rows = _store(tmp_path)
    gone = keys[::7]
    assert s.delete(gone) == gone.size
    assert s.stats["tombstone_files"] == 1
    s.load(keys[1::50])
    assert s.relayout() == 5  # the five parameter files, not the tombstone file
    s.close()
    again = SSDPS(tmp_path / "ssd")
    got, found = again.load(keys)
    kept = ~np.isin(keys, gone)
    assert np.array_equal(found, kept) and np.array_equal(got[kept], rows[kept])
    again.close()


def test_without_load_heat_a_relayout_keeps_the_order_it_reads(tmp_path):
    s, keys, rows = _store(tmp_path, heat_counters=0)
    assert s.state.heat is None
    for _ in range(3):
        s.load(keys[::50])
    assert s.relayout() == 5
    files, pos = _where(s, keys)
    assert np.array_equal(np.argsort(files * 10_000 + pos, kind="stable"), np.arange(keys.size))  # key order
    got, found = s.load(keys)
    assert found.all() and np.array_equal(got, rows)
    s.close()


def test_load_heat_never_undercounts():
    h = LoadHeat(1 << 6)  # few counters: collisions overcount, never undercount
    keys = mix64_array(np.arange(500, dtype=np.uint64))
    for t in range(1, 4):
        h.count(keys[: 100 * t])
    est = h.estimate(keys)
    assert (est[:100] >= 3).all() and (est[100:200] >= 2).all() and (est[200:300] >= 1).all()
    assert LoadHeat(1 << 20).estimate(keys).sum() == 0
    with pytest.raises(ValueError, match="heat counters"):
        LoadHeat(0)


def test_load_heat_ages_so_keys_hot_long_ago_cool():
    h = LoadHeat(1 << 6)  # 64 counters a row: halves after 640 keys counted
    assert AGE_EVERY * 64 == 640
    old, new = mix64_array(np.arange(8, dtype=np.uint64)), mix64_array(np.arange(8, 16, dtype=np.uint64))
    for _ in range(8):
        h.count(old)  # 64 keys counted
    assert (h.estimate(old) >= 8).all()
    for _ in range(72):
        h.count(new)  # 576 more: 640 in all, one halving
    assert (h.estimate(old) == 4).all() and (h.estimate(new) == 36).all()  # 8 and 72, halved


def test_a_partial_load_counts_the_pages_its_reads_span(tmp_path):
    width = 128  # one-row blocks: a missed row is read alone, its key not at all
    s = SSDPS(tmp_path / "ssd", width, rows_per_file=1000, background=False)
    keys = np.arange(1, 1001, dtype=np.uint64)
    s.dump(keys, np.ones((keys.size, width), np.float32))
    base = HEADER_BYTES + 16 * keys.size  # where the rows start

    def pages(positions: list[int]) -> int:
        before = s.stats
        _, found = s.load(keys[positions])
        assert found.all() and s.stats["files_read_partially"] == before["files_read_partially"] + 1
        return s.stats["pages_read"] - before["pages_read"]

    def span(first: int, last: int) -> int:  # pages of rows first..last read as one range
        return (base + 512 * (last + 1) - 1) // 4096 - (base + 512 * first) // 4096 + 1

    assert pages([10]) == span(10, 10)
    assert pages([10, 11]) == span(10, 11)  # neighbours: one range
    assert pages([10, 500]) == span(10, 10) + span(500, 500)  # far apart: a range each
    s.close()


def test_bench_layout_reports_both_layouts_and_that_they_hold_the_same_rows(tmp_path):
    assert BENCHMARKS["layout"] == "hpsray.bench.layout"
    p = argparse.ArgumentParser()
    layout.add_arguments(p)
    argv = ["--rows", "20000", "--width", "8", "--batch", "4096", "--batches", "4", "--dir", str(tmp_path)]
    report = layout.run(p.parse_args(argv))
    assert report["same_rows"] is True
    for arm in ("as_read", "by_heat"):
        second = report[arm]["second_pass"]
        assert second["rows_missed"] > 0 and second["pages_read"] > 0
        assert report[arm]["relayout"]["files"] > 0
    assert report["as_read"]["second_pass"]["rows_missed"] == report["by_heat"]["second_pass"]["rows_missed"]
    assert report["pages_per_missed_row_gain"] > 0 and 0 < report["oracle_pages_per_missed_row"] <= 2
