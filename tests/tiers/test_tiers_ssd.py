from __future__ import annotations

import errno
import os
import threading
import tracemalloc

import numpy as np
import pytest

from hpsray.errors import CorruptFileError, SSDError, SSDFullError
from hpsray.tiers.ssd import SSDPS
from hpsray.tiers.ssd.manifest import NAME as MANIFEST
from hpsray.tiers.ssd.paramfile import (
    HEADER_BYTES,
    block_rows_for,
    file_bytes,
    file_name,
    record_bytes,
)
from hpsray.tiers.ssd.store import MERGE_SMALL_FILES

W = 6


def rows_for(keys: np.ndarray, version: int) -> np.ndarray:
    r = np.empty((keys.size, W), np.float32)
    r[:, 0] = keys
    r[:, 1] = version
    r[:, 2:] = np.arange(W - 2, dtype=np.float32) + version * 0.25
    return r


class Model:
    """The reference: a dict of the latest value of each key."""

    def __init__(self) -> None:
        self.rows: dict[int, np.ndarray] = {}

    def dump(self, keys, rows) -> None:
        for k, r in zip(keys.tolist(), rows):
            self.rows[k] = r.copy()

    def check(self, store: SSDPS) -> None:
        keys = np.array(sorted(self.rows), dtype=np.uint64)
        got, found = store.load(keys)
        assert found.all()
        assert np.array_equal(got, np.stack([self.rows[k] for k in keys.tolist()]))
        assert len(store) == len(self.rows)


def test_round_trip_and_absent_keys(tmp_path):
    with SSDPS(tmp_path / "s", W, rows_per_file=50) as s:
        keys = np.arange(10, 310, dtype=np.uint64)
        s.dump(keys, rows_for(keys, 1))
        query = np.array([5, 10, 309, 1000, 10, 150], dtype=np.uint64)
        got, found = s.load(query)
        assert found.tolist() == [False, True, True, False, True, True]
        assert np.array_equal(got[found], rows_for(query[found], 1))
        assert np.all(got[~found] == 0)
        assert s.contains(query).tolist() == found.tolist()
        st = s.stats
        assert st["files"] == 6 and st["live_rows"] == 300 and st["files_read"] == 3
        empty, f = s.load(np.empty(0, np.uint64))
        assert empty.shape == (0, W) and f.size == 0


def test_last_duplicate_wins_and_overwrites(tmp_path):
    with SSDPS(tmp_path / "s", W, rows_per_file=8) as s:
        keys = np.array([3, 1, 3, 2, 1], dtype=np.uint64)
        rows = rows_for(keys, 1)
        rows[:, 1] = np.arange(5)
        s.dump(keys, rows)
        got, _ = s.load(np.array([1, 2, 3], dtype=np.uint64))
        assert got[:, 1].tolist() == [4, 3, 2]
        s.dump(np.array([2], np.uint64), rows_for(np.array([2], np.uint64), 9))
        got, _ = s.load(np.array([1, 2, 3], dtype=np.uint64))
        assert got[:, 1].tolist() == [4, 9, 2]


def test_a_dump_of_distinct_keys_in_order_does_not_copy_its_rows(tmp_path):
    """MEM-PS hands its writes over sorted and distinct: the store writes them as they are, so a
    flush of N bytes of rows does not need 2N (a copy of every row was the bench's OOM kill)."""
    width = 64
    with SSDPS(tmp_path / "s", width, rows_per_file=1024) as s:
        keys = np.arange(1, 100_001, dtype=np.uint64) * 7
        rows = np.random.default_rng(0).random((keys.size, width), dtype=np.float32)
        s.dump(keys, rows)  # the keys' slots in the key map are made here, not below
        peaks = {}
        for order in ("sorted", "reversed"):
            k, r = (keys, rows) if order == "sorted" else (keys[::-1].copy(), rows[::-1].copy())
            tracemalloc.start()
            try:
                s.dump(k, r)
                peaks[order] = tracemalloc.get_traced_memory()[1] / rows.nbytes
            finally:
                tracemalloc.stop()
        assert peaks["sorted"] < 0.5, peaks  # no row copied (file buffers and key positions only)
        assert peaks["reversed"] > 1.0, peaks  # out of order: put in order first, a copy
        got, found = s.load(keys)
        assert found.all() and np.array_equal(got, rows)


def test_stale_counters_follow_overwrites(tmp_path):
    with SSDPS(tmp_path / "s", W, rows_per_file=10, background=False, max_space_ratio=None) as s:
        keys = np.arange(30, dtype=np.uint64)  # files hold keys 0-9, 10-19, 20-29
        s.dump(keys, rows_for(keys, 1))
        s.dump(np.array([1, 2, 3, 25], np.uint64), rows_for(np.array([1, 2, 3, 25], np.uint64), 2))
        files = s.file_stats()
        assert [(f["rows"], f["stale"]) for f in files] == [(10, 3), (10, 0), (10, 1), (4, 0)]
        s.dump(np.array([1, 2, 3], np.uint64), rows_for(np.array([1, 2, 3], np.uint64), 3))
        files = s.file_stats()
        assert [f["stale"] for f in files] == [3, 0, 1, 3, 0]
        assert s.stats["stale_rows"] == 7 and s.stats["live_rows"] == 30


def test_compaction_keeps_every_live_row_and_bounds_disk(tmp_path):
    rng = np.random.default_rng(0)
    model = Model()
    with SSDPS(tmp_path / "s", W, rows_per_file=64, background=False, max_space_ratio=None) as s:
        keys = np.arange(2000, dtype=np.uint64)
        s.dump(keys, rows_for(keys, 0))
        model.dump(keys, rows_for(keys, 0))
        for v in range(1, 12):
            k = rng.choice(keys, 700, replace=False)
            s.dump(k, rows_for(k, v))
            model.dump(k, rows_for(k, v))
        assert s.stats["space_ratio"] > 2.0  # nothing compacted yet
        assert s.compact() > 0
        st = s.stats
        assert st["space_ratio"] <= 2.0 and st["compactions"] > 0
        for f in s.file_stats():  # the rule: no file stays more than half stale
            assert HEADER_BYTES + f["stale"] * record_bytes(W) <= 0.5 * f["bytes"]
        model.check(s)
        s.compact(full=True)
        st = s.stats
        assert st["stale_rows"] == 0  # only headers and block tables remain beyond the live bytes
        assert st["disk_bytes"] == sum(file_bytes(f["rows"], W) for f in s.file_stats())
        assert st["disk_bytes"] - st["live_bytes"] <= (HEADER_BYTES + 4) * st["files"] + st["live_rows"] // 2
        model.check(s)
    with SSDPS(tmp_path / "s") as s:  # and the compacted state survives reopening
        model.check(s)


def test_background_compaction_bounds_disk_after_every_dump(tmp_path):
    rng = np.random.default_rng(1)
    model = Model()
    with SSDPS(tmp_path / "s", W, rows_per_file=32, compact_trigger=1.3) as s:
        keys = np.arange(1500, dtype=np.uint64)
        for v in range(25):
            k = keys if v == 0 else rng.choice(keys, 400, replace=False)
            s.dump(k, rows_for(k, v))
            model.dump(k, rows_for(k, v))
            assert s.stats["space_ratio"] <= 2.0  # backpressure: a dump returns below the bound
        assert s.wait_compaction(timeout=30)
        assert s.stats["space_ratio"] <= 1.3 + 1e-9 or not s.needs_compaction()
        assert s.stats["compactions"] > 0 and s.stats["compaction_errors"] == 0
        model.check(s)


def dump_small(s, model, i: int) -> None:
    """Dump 7 new rows (keys ``7i .. 7i+6``, version ``i``) into ``s`` and ``model``: an
    eviction of a few rows, a small file."""
    k = np.arange(i * 7, i * 7 + 7, dtype=np.uint64)
    s.dump(k, rows_for(k, i))
    model.dump(k, rows_for(k, i))


def test_small_dumps_are_merged_into_full_files(tmp_path):
    model = Model()
    with SSDPS(tmp_path / "s", W, rows_per_file=100, merge_small_files=4) as s:
        for i in range(30):  # evictions of a few rows at a time
            dump_small(s, model, i)
        assert s.wait_compaction(timeout=30)
        sizes = [f["rows"] for f in s.file_stats()]
        assert sum(n < 50 for n in sizes) < 4 and len(sizes) <= 6, sizes  # from 30 files of 7 rows
        assert s.stats["compactions"] > 0
        model.check(s)


def test_small_files_are_left_alone_until_there_are_many_of_them(tmp_path):
    """Merging rewrites live rows only to make files bigger: with the default
    ``merge_small_files``, dozens of small dumps of new rows (nothing stale) compact nothing;
    at MERGE_SMALL_FILES small files they are merged (docs/tiers.md, Compaction)."""
    model = Model()
    with SSDPS(tmp_path / "s", W, rows_per_file=100) as s:
        for i in range(40):
            dump_small(s, model, i)
        assert s.wait_compaction(timeout=30)
        assert s.stats["compactions"] == 0 and s.stats["compaction_bytes_read"] == 0
        assert len(s.file_stats()) == 40
        for i in range(40, MERGE_SMALL_FILES):
            dump_small(s, model, i)
        assert s.wait_compaction(timeout=60)
        assert s.stats["compactions"] > 0
        assert sum(f["rows"] < 50 for f in s.file_stats()) < MERGE_SMALL_FILES
        model.check(s)


def load_while_dumping(s, stable, hot, rounds: int, per_round: int, rng) -> list[str]:
    """Load ``stable`` (stored at version 0) over and over on a thread while ``rounds`` dumps of
    ``per_round`` random ``hot`` keys (versions 1, 2, ...) drive compaction; the reader's errors."""
    errors, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                got, found = s.load(stable)
            except Exception as e:  # noqa: BLE001 - reported by the caller
                errors.append(repr(e))
                return
            if not found.all() or not np.array_equal(got, rows_for(stable, 0)):
                errors.append("stable rows changed")
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for v in range(1, rounds + 1):
            k = rng.choice(hot, per_round, replace=False)
            s.dump(k, rows_for(k, v))
    finally:
        stop.set()
        t.join()
    return errors


def test_loads_stay_correct_while_compaction_moves_rows(tmp_path):
    rng = np.random.default_rng(2)
    with SSDPS(tmp_path / "s", W, rows_per_file=16, compact_trigger=1.05, io_threads=3) as s:
        keys = np.arange(3000, dtype=np.uint64)
        s.dump(keys, rows_for(keys, 0))
        stable = keys[::3]  # never rewritten, but their files get compacted
        hot = np.setdiff1d(keys, stable)
        assert not load_while_dumping(s, stable, hot, rounds=29, per_round=500, rng=rng)
        assert s.stats["compactions"] > 0


def test_partial_loads_stay_correct_while_compaction_retires_their_files(tmp_path):
    """Partial reads (merged block ranges read through descriptors opened under the lock):
    compaction retiring a file that a load is reading must leave that load correct."""
    rng = np.random.default_rng(4)
    br = block_rows_for(W)
    rpf = 40 * br
    with SSDPS(tmp_path / "s", W, rows_per_file=rpf, compact_trigger=1.05, io_threads=3) as s:
        keys = np.arange(8 * rpf, dtype=np.uint64)
        s.dump(keys, rows_for(keys, 0))
        stable = keys[:: 7 * br]  # a few blocks of every file: partial reads
        hot = np.setdiff1d(keys, stable)
        assert not load_while_dumping(s, stable, hot, rounds=24, per_round=rpf // 2, rng=rng)
        st = s.stats
        assert st["compactions"] > 0 and st["files_read_partially"] > 0


def test_reopen_rebuilds_the_mapping(tmp_path):
    rng = np.random.default_rng(3)
    model = Model()
    with SSDPS(tmp_path / "s", W, rows_per_file=40, background=False, max_space_ratio=None) as s:
        for v in range(6):
            k = rng.choice(5000, 900, replace=False).astype(np.uint64)
            s.dump(k, rows_for(k, v))
            model.dump(k, rows_for(k, v))
        s.compact()
        before = s.stats
        files_before = s.file_stats()
    with SSDPS(tmp_path / "s") as s:  # width taken from the manifest
        assert s.width == W
        model.check(s)
        after = s.stats
        for key in ("files", "live_rows", "disk_bytes", "stale_rows"):
            assert after[key] == before[key], key
        assert s.file_stats() == files_before
        k = np.array([1, 2, 3], np.uint64)
        s.dump(k, rows_for(k, 99))  # new file numbers continue after the old ones
        model.dump(k, rows_for(k, 99))
        assert s.file_stats()[-1]["file_no"] > files_before[-1]["file_no"]
        model.check(s)
    with pytest.raises(ValueError, match="width"):
        SSDPS(tmp_path / "s", W + 1)
    with pytest.raises(FileNotFoundError, match="no SSD-PS store"):
        SSDPS(tmp_path / "nothing-here")


def test_files_outside_the_manifest_are_garbage(tmp_path):
    d = tmp_path / "s"
    with SSDPS(d, W, rows_per_file=10) as s:
        k = np.arange(25, dtype=np.uint64)
        s.dump(k, rows_for(k, 1))
    (d / (file_name(999) + ".tmp")).write_bytes(b"half a file")
    (d / file_name(998)).write_bytes(b"renamed but never recorded")
    with SSDPS(d) as s:
        assert s.stats["garbage_files_removed"] == 2
        assert sorted(os.listdir(d)) == sorted([MANIFEST] + [file_name(f["file_no"]) for f in s.file_stats()])
        got, found = s.load(k)
        assert found.all() and np.array_equal(got, rows_for(k, 1))


def test_torn_manifest_tail_is_dropped_but_damage_inside_is_an_error(tmp_path):
    d = tmp_path / "s"
    with SSDPS(d, W, rows_per_file=10) as s:
        for v in range(3):
            k = np.arange(v * 10, v * 10 + 10, dtype=np.uint64)
            s.dump(k, rows_for(k, v))
    path = d / MANIFEST
    good = path.read_bytes()
    path.write_bytes(good + b"\x40\x00\x00\x00\x12\x34")  # an append cut short by a crash
    with SSDPS(d) as s:
        assert len(s) == 30
    assert path.read_bytes() == good  # truncated back to the last whole record
    damaged = bytearray(good)
    damaged[len(good) // 2] ^= 0xFF  # a record in the middle
    path.write_bytes(bytes(damaged))
    with pytest.raises(CorruptFileError, match="MANIFEST.*not a torn append"):
        SSDPS(d)


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_corrupt_rows_are_detected_on_load(tmp_path):
    d = tmp_path / "s"
    s = SSDPS(d, W, rows_per_file=100)
    k = np.arange(100, dtype=np.uint64)
    s.dump(k, rows_for(k, 1))
    f = d / file_name(s.file_stats()[0]["file_no"])
    _flip(f, HEADER_BYTES + 100 * record_bytes(W) - 3)  # inside the rows section (the last row)
    with pytest.raises(CorruptFileError, match=f"{f.name}.*rows checksum"):
        s.load(k[::2])  # many rows: the whole file is read
    with pytest.raises(CorruptFileError, match="rows checksum"):
        s.verify()
    s.close()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: _flip(f, HEADER_BYTES + 8), "index checksum"),  # a key
        (lambda f: _flip(f, 20), "header checksum"),
        (lambda f: _flip(f, 0), "not an hpsray parameter file"),
        (lambda f: f.write_bytes(f.read_bytes()[:-10]), "size"),
        (lambda f: f.unlink(), "missing"),
    ],
    ids=["key", "header", "magic", "truncated", "missing"],
)
def test_damaged_files_are_named_on_reopen(tmp_path, damage, message):
    d = tmp_path / "s"
    with SSDPS(d, W, rows_per_file=100) as s:
        k = np.arange(100, dtype=np.uint64)
        s.dump(k, rows_for(k, 1))
        name = file_name(s.file_stats()[0]["file_no"])
    damage(d / name)
    with pytest.raises(CorruptFileError, match=message) as e:
        SSDPS(d)
    assert name in str(e.value)


def _failing_writer(budget: list[int], only: str | None = None):
    """An ``os.write`` that raises ENOSPC once ``budget[0]`` bytes are spent (optionally only
    for files whose name contains ``only``)."""

    def write(fd, data):
        if only is not None and only not in os.readlink(f"/proc/self/fd/{fd}"):
            return os.write(fd, data)
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = os.write(fd, data[: budget[0]])
        budget[0] -= n
        return n

    return write


@pytest.mark.parametrize("only", [None, MANIFEST], ids=["parameter-file", "manifest"])
def test_disk_full_is_a_clear_error_and_the_store_stays_readable(tmp_path, only):
    d = tmp_path / "s"
    budget = [10**9]
    s = SSDPS(d, W, rows_per_file=16, write=_failing_writer(budget, only))
    k = np.arange(100, dtype=np.uint64)
    s.dump(k, rows_for(k, 1))
    budget[0] = 50  # the next write runs out of space part-way
    k2 = np.arange(50, 150, dtype=np.uint64)
    with pytest.raises(SSDFullError, match="no space left") as e:
        s.dump(k2, rows_for(k2, 2))
    assert e.value.errno == errno.ENOSPC
    got, found = s.load(np.arange(150, dtype=np.uint64))  # nothing of the failed dump is visible
    assert found[:100].all() and not found[100:].any()
    assert np.array_equal(got[:100], rows_for(k, 1))
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]
    budget[0] = 10**9  # space comes back: the store carries on
    s.dump(k2, rows_for(k2, 3))
    s.close()
    with SSDPS(d) as s:
        got, found = s.load(np.arange(150, dtype=np.uint64))
        assert found.all()
        assert np.array_equal(got[:50], rows_for(k[:50], 1))
        assert np.array_equal(got[50:], rows_for(k2, 3))


def test_disk_full_on_a_real_small_filesystem(tmpfs):
    mnt = tmpfs("1m")  # skipped where it cannot be mounted; the injected-ENOSPC test covers the logic
    s = SSDPS(mnt / "s", 32, rows_per_file=256, background=False)
    acked = Model()
    rng = np.random.default_rng(4)
    with pytest.raises(SSDFullError):
        for v in range(1000):
            k = rng.choice(20_000, 500, replace=False).astype(np.uint64)
            r = np.repeat(rows_for(k, v), 6, axis=1)[:, :32]
            s.dump(k, r)
            acked.dump(k, r)
    keys = np.array(sorted(acked.rows), dtype=np.uint64)
    got, found = s.load(keys)  # every acknowledged row is still readable
    assert found.all() and np.array_equal(got, np.stack([acked.rows[k] for k in keys.tolist()]))
    s.close()
    with SSDPS(mnt / "s") as s2:
        got, found = s2.load(keys)
        assert found.all() and np.array_equal(got, np.stack([acked.rows[k] for k in keys.tolist()]))


def test_a_dump_during_compaction_wins_after_reopen(tmp_path):
    """Compaction copies a row while a newer dump of it lands: the copy carries the old
    version, so neither the live mapping nor a reopen may pick it."""
    d = tmp_path / "s"
    s = SSDPS(d, W, rows_per_file=10, background=False, max_space_ratio=None)
    k = np.arange(40, dtype=np.uint64)
    s.dump(k, rows_for(k, 1))
    s.dump(k[:8], rows_for(k[:8], 2))  # file 1 (keys 0-9) is now 80 % stale
    racing = np.array([8, 9], np.uint64)  # live in file 1, about to be copied

    def hook(point):  # after the victims were read, before the outputs get their numbers
        if point == "compaction:read":
            s.state.hook = lambda p: None
            s.dump(racing, rows_for(racing, 3))

    s.state.hook = hook
    assert s._compact_pass() == 1  # one pass: a second one would drop the all-stale output
    got, _ = s.load(racing)
    assert got[:, 1].tolist() == [3, 3]
    assert s.file_stats()[-1]["compacted"]  # the stale copy sits in the newest file
    s.close()
    with SSDPS(d) as s:
        got, _ = s.load(k)
        assert got[:8, 1].tolist() == [2] * 8
        assert got[8:10, 1].tolist() == [3, 3]
        assert got[10:, 1].tolist() == [1] * 30


def test_width_zero_and_lifecycle(tmp_path):
    s = SSDPS(tmp_path / "s", 0, rows_per_file=4)
    k = np.arange(1, 11, dtype=np.uint64)
    s.dump(k, np.empty((10, 0), np.float32))
    rows, found = s.load(np.arange(0, 12, dtype=np.uint64))
    assert rows.shape == (12, 0) and found.tolist() == [False] + [True] * 10 + [False]
    assert "rows=10" in repr(s)
    s.close()
    s.close()  # idempotent
    with pytest.raises(SSDError, match="closed"):
        s.load(k)
    with pytest.raises(SSDError, match="closed"):
        s.dump(k, np.empty((10, 0), np.float32))
    with pytest.raises(ValueError, match="expected shape"):
        SSDPS(tmp_path / "t", 3).dump(k, np.zeros((10, 4), np.float32))


def test_sparse_loads_read_only_checksummed_blocks(tmp_path):
    d = tmp_path / "s"
    n = 40 * block_rows_for(W)
    with SSDPS(d, W, rows_per_file=n) as s:
        k = np.arange(1, n + 1, dtype=np.uint64)
        s.dump(k, rows_for(k, 3))
        want = k[[5, 7, n - 1]]  # 2 of 40 blocks
        rows, found = s.load(want[::-1])
        assert found.all() and np.array_equal(rows, rows_for(want[::-1], 3))
        st = s.stats
        assert st["files_read_partially"] == 1
        assert st["bytes_read"] < file_bytes(n, W) // 10
        rows, found = s.load(k)  # every block: whole file
        assert np.array_equal(rows, rows_for(k, 3)) and s.stats["files_read_partially"] == 1
    with SSDPS(d) as s:  # tables come back on reopen
        rows, _ = s.load(want)
        assert np.array_equal(rows, rows_for(want, 3)) and s.stats["files_read_partially"] == 1


@pytest.mark.parametrize("where", ["row", "key"])
def test_sparse_loads_detect_damage_in_the_blocks_they_read(tmp_path, where):
    d = tmp_path / "s"
    br = block_rows_for(W)
    n = 40 * br
    s = SSDPS(d, W, rows_per_file=n)
    k = np.arange(1, n + 1, dtype=np.uint64)
    s.dump(k, rows_for(k, 1))
    f = d / file_name(s.file_stats()[0]["file_no"])
    p = 3 * br + 1  # a row of block 3
    off = HEADER_BYTES + 16 * n + 4 * W * p + 2 if where == "row" else HEADER_BYTES + 8 * p + 1
    _flip(f, off)
    rows, _ = s.load(k[[0, 10 * br]])  # other blocks: still served, and correct
    assert np.array_equal(rows, rows_for(k[[0, 10 * br]], 1))
    with pytest.raises(CorruptFileError, match=f"{f.name}.*block 3 checksum"):
        s.load(k[[0, p - 1]])
    s.close()


def test_format_1_files_are_still_read(tmp_path):
    """Files written before block tables existed (format 1) load whole, reopen and compact."""
    import zlib

    from hpsray.tiers.ssd import paramfile as pfmod

    d = tmp_path / "s"
    with SSDPS(d, W, rows_per_file=50) as s:
        k = np.arange(1, 101, dtype=np.uint64)
        s.dump(k, rows_for(k, 1))
        nos = [f["file_no"] for f in s.file_stats()]
    for no in nos:  # rewrite each file in format 1: no block table, version 1 header
        path = d / file_name(no)
        pf = pfmod.read_file(str(path))
        h = pf.header
        head = pfmod._HEADER.pack(
            pfmod.MAGIC, 1, h.width, h.n, h.file_no, h.flags, h.index_crc, h.rows_crc, 0, 0, b"\0" * 8
        )
        data = (
            head
            + zlib.crc32(head).to_bytes(4, "little")
            + pf.keys.tobytes()
            + pf.versions.tobytes()
            + pf.rows.tobytes()
        )
        path.write_bytes(data)
    with SSDPS(d) as s:
        rows, found = s.load(k[[3, 60]])
        assert found.all() and np.array_equal(rows, rows_for(k[[3, 60]], 1))
        assert s.stats["files_read_partially"] == 0
        s.dump(k[:60], rows_for(k[:60], 2))
        s.compact(full=True)
        rows, _ = s.load(k)
        assert np.array_equal(rows[:60], rows_for(k[:60], 2)) and np.array_equal(rows[60:], rows_for(k[60:], 1))


def test_format_2_files_are_read_whole_until_compaction_rewrites_them(tmp_path):
    """Format 2 block tables used another block hash: such files still open, load (whole, crc32
    verified) and compact; the compacted copies are format 3 and serve partial loads."""
    import zlib

    from hpsray.tiers.ssd import paramfile as pfmod

    d = tmp_path / "s"
    n = 40 * block_rows_for(W)
    with SSDPS(d, W, rows_per_file=n) as s:
        k = np.arange(1, n + 1, dtype=np.uint64)
        s.dump(k, rows_for(k, 1))
        nos = [f["file_no"] for f in s.file_stats()]
    for no in nos:  # the same file with a version 2 header
        path = d / file_name(no)
        data = bytearray(path.read_bytes())
        data[8:12] = (2).to_bytes(4, "little")
        data[60:64] = zlib.crc32(bytes(data[:60])).to_bytes(4, "little")
        path.write_bytes(bytes(data))
        assert pfmod.read_index(str(path)).header.version == 2
    with SSDPS(d, background=False) as s:
        rows, found = s.load(k[[3, n - 1]])
        assert found.all() and np.array_equal(rows, rows_for(k[[3, n - 1]], 1))
        assert s.stats["files_read_partially"] == 0
        s.dump(k[: n // 2 + 8], rows_for(k[: n // 2 + 8], 2))
        s.compact(full=True)
        rows, _ = s.load(k[[3, n - 1]])
        assert np.array_equal(rows, np.stack([rows_for(k[[3]], 2)[0], rows_for(k[[n - 1]], 1)[0]]))
        assert s.stats["files_read_partially"] >= 1  # the rewritten (format 3) files


def test_scan_sees_every_row_while_background_compaction_runs(tmp_path):
    """Small dumps make compaction merge files; a scan running meanwhile must not miss the rows
    a pass moves from a file it has not reached yet into a new file."""
    with SSDPS(tmp_path / "s", W, rows_per_file=64, merge_small_files=2, compact_trigger=1.0) as s:
        k = np.arange(1, 2001, dtype=np.uint64)
        for i in range(0, k.size, 10):  # 200 small files
            s.dump(k[i : i + 10], rows_for(k[i : i + 10], 1))
        for _ in range(3):
            seen = []
            for keys, _rows in s.scan():
                seen.append(keys)
                s._compaction.wake.set()  # nudge the compaction thread between files
                time_slice = threading.Event()
                time_slice.wait(0.002)
            got = np.sort(np.concatenate(seen))
            assert np.array_equal(got, k)


def test_a_key_moved_then_deleted_during_a_load_comes_back_absent(tmp_path):
    """A later whole-file round finds its file retired by compaction and looks its keys up
    again; a key deleted meanwhile comes back absent (zero row, not found), the rest as stored."""
    with SSDPS(tmp_path / "s", W, rows_per_file=16, background=False, max_space_ratio=None) as s:
        keys = np.arange(1, 161, dtype=np.uint64)  # 10 files
        s.dump(keys, rows_for(keys, 0))
        s.dump(keys[::16], rows_for(keys[::16], 1))  # a stale row in every file: compaction moves them all
        reads = s._reads
        reads.round_files = 2
        original = reads._open_round
        calls, victims = [], []

        def open_round(k, group_slots, starts, idx, pos, file_no, gone):
            calls.append(1)
            if len(calls) == 2:  # round 2: its files compacted away and one of its keys deleted
                victim = k[idx[starts[int(group_slots[0])] + 1]]
                s.compact(full=True)
                assert s.delete(np.array([victim], np.uint64)) == 1
                victims.append(int(victim))
            return original(k, group_slots, starts, idx, pos, file_no, gone)

        reads._open_round = open_round
        got, found = s.load(keys)
        assert len(victims) == 1 and s.stats["compactions"] > 0
        gone = keys == victims[0]
        assert not found[gone].any() and found[~gone].all()
        assert not got[gone].any()
        np.testing.assert_array_equal(got[~gone & (keys % 16 != 1)], rows_for(keys[~gone & (keys % 16 != 1)], 0))
        np.testing.assert_array_equal(got[keys % 16 == 1], rows_for(keys[keys % 16 == 1], 1))
