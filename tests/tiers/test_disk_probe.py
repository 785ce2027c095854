"""The disk's random-read bound (:mod:`hpsray.tiers.ssd.probe`) on a real file, and the reads a
load issues (``reads_issued``), which the load stage's rate is compared with."""

from __future__ import annotations

import numpy as np
import pytest

from hpsray import uring
from hpsray.tiers.ssd import SSDPS
from hpsray.tiers.ssd.probe import PAGE, DiskBound, DiskCounters, probe, read_size, scratch_file


def _no_ring(*_: object) -> uring.Ring:
    raise OSError(38, "io_uring_setup: Function not implemented")


def _ring_works() -> bool:
    try:
        uring.Ring().close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("ring", [True, False])
def test_probe_reads_random_pages_of_a_real_file_per_depth(tmp_path, ring, monkeypatch):
    if not ring:  # a kernel without io_uring: the depth comes from threads
        monkeypatch.setattr(uring, "Ring", _no_ring)
    path = scratch_file(str(tmp_path), 4 << 20)
    bound = probe([path], 1000, depths=(1, 4), seconds=10.0, max_reads=300)
    assert bound.to_dict()["issued_by"] == ("io_uring" if ring and _ring_works() else "threads")
    assert bound.read_bytes == PAGE == read_size(1000)  # whole pages, as the page cache reads
    assert bound.reads == {1: 300, 4: 300}  # the read budget ends each depth, not the clock
    for d in (1, 4):
        assert bound.reads_per_s[d] > 0
        assert bound.bytes_per_s[d] == pytest.approx(bound.reads_per_s[d] * PAGE)
    assert bound.span_bytes == 4 << 20 and bound.files == 1
    assert bound.direct or "O_DIRECT refused" in bound.note  # tmpfs: says it measured the cache
    assert set(bound.to_dict()["by_depth"]) == {"1", "4"}


def test_probe_refuses_files_smaller_than_one_read(tmp_path):
    small = tmp_path / "small"
    small.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="no file of 1 holds a read of 4096 bytes"):
        probe([str(small)], 4096, max_reads=10)


def test_bound_between_depths_is_interpolated():
    b = DiskBound(4096, True, 0, 1, {1: 100.0, 8: 800.0, 32: 1600.0}, {}, {}, {}, 0.0)
    assert b.at(8) == 800.0 and b.at(4) == pytest.approx(100 + 3 / 7 * 700)
    assert b.at(64) == 1600.0 and b.at(0) == 100.0


def test_device_counters_count_reads_of_the_disk(tmp_path):
    path = scratch_file(str(tmp_path), 1 << 20)
    before = DiskCounters.of(path)
    if before is None:
        pytest.skip("no block device under tmp_path (tmpfs, overlay)")
    probe([path], PAGE, depths=(2,), max_reads=64)
    d = DiskCounters.of(path).since(before)  # type: ignore[union-attr]
    if probe([path], PAGE, depths=(1,), max_reads=1).direct:
        assert d["reads"] >= 64  # O_DIRECT reads reach the device (other processes' too)
    assert d["seconds"] > 0 and d["mean_reads_in_flight"] >= 0


def test_loads_count_the_reads_they_issue(tmp_path):
    width, rpf = 4, 4096  # blocks of 64 rows (1 KiB of row data), one chunk of rows per file
    keys = np.arange(1, rpf + 1, dtype=np.uint64)
    with SSDPS(tmp_path / "s", width, rows_per_file=rpf, background=False) as s:
        s.dump(keys, np.zeros((rpf, width), np.float32))
        s.load(keys[[0, 10 * 64]])  # two blocks far apart: their keys and their rows, 4 ranges
        st = s.stats
        assert st["files_read_partially"] == 1 and st["reads_issued"] == 4
        s.load(keys)  # whole: header, index, one chunk of rows, block table
        st = s.stats
        assert st["files_read_partially"] == 1 and st["reads_issued"] == 4 + 4
        assert st["load_cpu_seconds"] > 0
