"""A full disk, for real: a 1 MiB tmpfs. Each refusal names the directory and the bytes needed, and
leaves the previous state (store rows, latest checkpoint) usable."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from hpsray.checkpoint import Checkpoints, node_dir
from hpsray.errors import CheckpointFullError, DiskFullError, SSDFullError
from hpsray.tiers.ssd import SSDPS
from hpsray.tiers.ssd.paramfile import file_bytes

FP = "job-1"
W = 32


def rows_for(keys: np.ndarray, v: float) -> np.ndarray:
    return np.repeat(keys[:, None].astype(np.float32) + v, W, axis=1)


def test_an_ssd_dump_that_does_not_fit_names_the_directory_and_the_bytes_needed(small_fs, ssd_warm):
    d = small_fs / "s"
    with SSDPS(d, W, rows_per_file=1024, background=False) as s:
        k = np.arange(1000, dtype=np.uint64)
        s.dump(k, rows_for(k, 0))  # 145 KB: fits
        big = np.arange(10_000, 20_000, dtype=np.uint64)  # 1.4 MB: does not
        with pytest.raises(SSDFullError) as e:
            s.dump(big, rows_for(big, 1))
        needed = sum(file_bytes(min(1024, big.size - i * 1024), W) for i in range(10))
        err = e.value
        assert isinstance(err, DiskFullError) and err.errno == errno.ENOSPC
        assert err.directory == str(d) and err.needed == needed and err.free is not None and err.free < needed
        assert (
            f"SSD-PS {d}: no space left: writing 10000 rows in 10 parameter files needs {needed} bytes, "
            f"{err.free} bytes are free" in str(err)
        )
        assert "nothing of this write was recorded" in str(err)
        got, found = s.load(np.concatenate([k, big[:5]]))
        assert found[: k.size].all() and not found[k.size :].any()
        assert np.array_equal(got[: k.size], rows_for(k, 0))


def test_a_snapshot_copied_onto_a_full_disk_is_removed_and_names_the_bytes(tmp_path, small_fs, ssd_warm):
    with SSDPS(tmp_path / "s", W, rows_per_file=2048, background=False) as s:
        k = np.arange(8000, dtype=np.uint64)
        s.dump(k, rows_for(k, 0))  # 1.2 MB on the big disk; links to the tmpfs fail (another file system)
        total = s.stats["disk_bytes"]
        with pytest.raises(SSDFullError) as e:
            s.snapshot(small_fs / "snap")
        assert e.value.directory == str(small_fs / "snap") and e.value.needed > total
        assert f"SSD-PS {small_fs / 'snap'}: no space left: a snapshot of 4 parameter files needs" in str(e.value)
        assert "the snapshot was removed; the store is unchanged" in str(e.value)
        assert os.listdir(small_fs) == []
        assert s.verify() == 4


def test_a_checkpoint_that_does_not_fit_leaves_the_previous_one_latest(small_fs):
    ckpts = Checkpoints(small_fs / "c")
    with ckpts.staged(1) as staging:
        (staging / "dense.pt").write_bytes(b"\1" * 400_000)
        ckpts.commit(staging, 1, {"n": 1}, fingerprint=FP)

    with pytest.raises(CheckpointFullError) as e:  # a writer runs out of space
        with ckpts.staged(2) as staging:
            node_dir(staging, 0).mkdir()
            (node_dir(staging, 0) / "rows.bin").write_bytes(b"\2" * 300_000)
            (staging / "dense.pt").write_bytes(b"\2" * 400_000)
    err = e.value
    assert err.directory == str(small_fs / "c") and err.needed >= 600_000 and err.free >= 600_000
    assert f"checkpoint directory {small_fs / 'c'}: no space left for the checkpoint of batch 2" in str(err)
    assert "the staging directory was removed and ckpt-000001 stays the latest checkpoint" in str(err)
    assert os.listdir(small_fs / "c") == ["ckpt-000001"]
    latest = ckpts.latest(FP)
    assert latest.batch == 1 and latest.meta == {"n": 1}
    latest.verify(FP)

    with pytest.raises(CheckpointFullError) as e:  # the writers fit, the commit's record does not
        with ckpts.staged(2) as staging:
            st = os.statvfs(small_fs)
            (staging / "dense.pt").write_bytes(b"\3" * (st.f_bavail * st.f_frsize))
            ckpts.commit(staging, 2, fingerprint=FP)
    assert isinstance(e.value.__cause__, OSError) and "batch 2" in str(e.value)
    assert os.listdir(small_fs / "c") == ["ckpt-000001"]
    assert ckpts.latest(FP).batch == 1

    with ckpts.staged(2) as staging:  # space enough again
        (staging / "dense.pt").write_bytes(b"\4" * 100_000)
        ckpts.commit(staging, 2, fingerprint=FP)
    assert ckpts.latest(FP).batch == 2 and len(ckpts.committed()) == 2
