"""SSD-PS snapshots: a consistent state by hard links, restored exactly, whatever compaction does after."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from hpsray.errors import CorruptFileError, SSDError
from hpsray.tiers.ssd import SSDPS, restore_snapshot, verify_snapshot
from hpsray.tiers.ssd.snapshot import NAME

W = 6


@pytest.fixture(scope="module", autouse=True)
def _warm(tmp_path_factory):
    """Load the numba kernels once (seconds on a busy machine), so each test times only itself."""
    with SSDPS(tmp_path_factory.mktemp("warm") / "s", W, rows_per_file=8, background=False) as s:
        k = np.arange(40, dtype=np.uint64)
        s.dump(k, rows_for(k, 0))
        s.dump(k, rows_for(k, 1))
        s.compact(full=True)
        s.load(k)
        list(s.scan())


def rows_for(keys: np.ndarray, version: int) -> np.ndarray:
    r = np.empty((keys.size, W), np.float32)
    r[:, 0] = keys
    r[:, 1] = version
    r[:, 2:] = np.arange(W - 2, dtype=np.float32) + version * 0.25
    return r


def state(store: SSDPS) -> dict[int, tuple]:
    """Every live row of ``store``, by key."""
    out = {}
    for keys, rows in store.scan():
        for k, r in zip(keys.tolist(), rows):
            out[k] = tuple(r.tolist())
    return out


def model_of(keys: np.ndarray, rows: np.ndarray, into: dict[int, tuple] | None = None) -> dict[int, tuple]:
    out = dict(into or {})
    for k, r in zip(keys.tolist(), rows):
        out[k] = tuple(r.tolist())
    return out


def test_restore_gives_the_snapshot_state_after_more_dumps_and_compaction(tmp_path):
    s = SSDPS(tmp_path / "s", W, rows_per_file=16, background=False, max_space_ratio=None)
    model: dict[int, tuple] = {}
    for v in range(3):
        k = np.arange(v * 20, v * 20 + 60, dtype=np.uint64)
        s.dump(k, rows_for(k, v))
        model = model_of(k, rows_for(k, v), model)
    snap_files = sorted(n for n in os.listdir(tmp_path / "s") if n.endswith(".hps"))
    info = s.snapshot(tmp_path / "snap")
    assert info["files"] == len(snap_files) and info["rows"] == len(model) == len(s)
    assert info["linked"] == info["files"] and info["copied"] == 0 and info["bytes"] > 0 and info["seconds"] >= 0
    assert sorted(n for n in os.listdir(tmp_path / "snap") if n.endswith(".hps")) == snap_files

    k = np.arange(0, 100, dtype=np.uint64)  # overwrite every row, then drop every stale file
    s.dump(k, rows_for(k, 9))
    s.compact(full=True)
    assert not set(snap_files) & set(os.listdir(tmp_path / "s"))  # compaction unlinked them all

    for target in ("r1", "r2"):  # the snapshot stays usable: restore it twice
        out = restore_snapshot(tmp_path / "snap", tmp_path / target)
        assert out["rows"] == len(model) and out["files"] == len(snap_files)
        with SSDPS(tmp_path / target) as r:
            assert r.width == W and state(r) == model
            r.dump(k[:5], rows_for(k[:5], 7))  # the restored store is a store: it takes dumps
    assert verify_snapshot(tmp_path / "snap")["rows"] == len(model)
    assert all(v[1] == 9 for v in state(s).values())  # the live store is untouched
    s.close()


def test_snapshot_waits_for_the_compaction_pass_in_flight(tmp_path):
    s = SSDPS(tmp_path / "s", W, rows_per_file=10, background=False, max_space_ratio=None)
    k = np.arange(40, dtype=np.uint64)
    s.dump(k, rows_for(k, 1))
    s.dump(k[:8], rows_for(k[:8], 2))  # the first file is 80 % stale: a victim
    expected = state(s)
    paused, resume = threading.Event(), threading.Event()

    def hook(point):
        if point == "compaction:written":  # outputs written, not yet recorded, victims not yet unlinked
            paused.set()
            resume.wait(5)

    s.state.hook = hook
    compacting = threading.Thread(target=s._compact_pass)
    compacting.start()
    assert paused.wait(5)
    result = {}
    snapping = threading.Thread(target=lambda: result.update(s.snapshot(tmp_path / "snap")))
    snapping.start()
    snapping.join(0.3)
    assert snapping.is_alive()  # blocked behind the pass
    resume.set()
    compacting.join(5)
    snapping.join(5)
    assert not snapping.is_alive() and result["rows"] == 40
    s.state.hook = lambda p: None
    restore_snapshot(tmp_path / "snap", tmp_path / "r")
    with SSDPS(tmp_path / "r") as r:
        assert state(r) == expected
    s.close()


def test_snapshots_under_background_compaction_and_concurrent_dumps(tmp_path):
    s = SSDPS(tmp_path / "s", W, rows_per_file=32, merge_small_files=2, compact_trigger=1.0)
    models = {0: {}}  # dump count -> the rows after that many dumps
    stop = threading.Event()

    def dumper():
        rng = np.random.default_rng(1)
        model: dict[int, tuple] = {}
        v = 0
        while not stop.is_set() and v < 4000:
            v += 1
            k = rng.choice(300, 12, replace=False).astype(np.uint64)
            s.dump(k, rows_for(k, v))  # dumps run one at a time; the count names this state
            model = model_of(k, rows_for(k, v), model)
            models[v] = model

    t = threading.Thread(target=dumper)
    t.start()
    try:
        infos = []  # snapshots until compaction has run beside them (bounded)
        while len(infos) < 4 or (s.stats["compactions"] == 0 and len(infos) < 40):
            threading.Event().wait(0.05)
            infos.append(s.snapshot(tmp_path / f"snap{len(infos)}"))
    finally:
        stop.set()
        t.join(10)
    assert s.stats["compactions"] > 0
    for i, info in enumerate(infos):
        restore_snapshot(tmp_path / f"snap{i}", tmp_path / f"r{i}")
        with SSDPS(tmp_path / f"r{i}") as r:
            assert state(r) == models[info["dumps"]], i
    s.close()


def test_a_truncated_snapshot_file_is_refused_with_the_reason(tmp_path):
    with SSDPS(tmp_path / "s", W, rows_per_file=16) as s:
        k = np.arange(50, dtype=np.uint64)
        s.dump(k, rows_for(k, 1))
        info = s.snapshot(tmp_path / "snap", link=False)  # copies: damaging it leaves the store alone
    assert info["copied"] == info["files"] == 4
    victim = sorted(p for p in (tmp_path / "snap").iterdir() if p.suffix == ".hps")[1]
    size = victim.stat().st_size
    os.truncate(victim, size - 10)
    with pytest.raises(CorruptFileError, match=rf"{victim}: size {size - 10} bytes, recorded {size} \(truncated"):
        verify_snapshot(tmp_path / "snap")
    with pytest.raises(CorruptFileError, match="truncated"):
        restore_snapshot(tmp_path / "snap", tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_damaged_rows_pass_the_header_check_and_fail_the_deep_one(tmp_path):
    with SSDPS(tmp_path / "s", W, rows_per_file=16) as s:
        k = np.arange(16, dtype=np.uint64)
        s.dump(k, rows_for(k, 1))
        s.snapshot(tmp_path / "snap", link=False)
    (f,) = [p for p in (tmp_path / "snap").iterdir() if p.suffix == ".hps"]
    data = bytearray(f.read_bytes())
    data[64 + 16 * 16 + 5] ^= 0xFF  # a bit of the rows section
    f.write_bytes(bytes(data))
    verify_snapshot(tmp_path / "snap")  # sizes and headers only
    with pytest.raises(CorruptFileError, match="rows checksum mismatch"):
        verify_snapshot(tmp_path / "snap", deep=True)
    os.remove(tmp_path / "snap" / NAME)
    with pytest.raises(CorruptFileError, match="SNAPSHOT.json: missing"):
        verify_snapshot(tmp_path / "snap")


def test_files_are_copied_where_links_fail(tmp_path, monkeypatch):
    with SSDPS(tmp_path / "s", W, rows_per_file=8) as s:
        k = np.arange(20, dtype=np.uint64)
        s.dump(k, rows_for(k, 1))

        def no_link(src, dst):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "link", no_link)
        info = s.snapshot(tmp_path / "snap")
        assert info["copied"] == info["files"] == 3 and info["linked"] == 0
        expected = state(s)
    out = restore_snapshot(tmp_path / "snap", tmp_path / "r")
    assert out["copied"] == 3
    with SSDPS(tmp_path / "r") as r:
        assert state(r) == expected


def test_restore_refuses_a_non_empty_target_unless_replace(tmp_path):
    with SSDPS(tmp_path / "s", W, rows_per_file=8) as s:
        k = np.arange(20, dtype=np.uint64)
        s.dump(k, rows_for(k, 1))
        s.snapshot(tmp_path / "snap")
        s.dump(k, rows_for(k, 2))  # the crashed run's later state
    with pytest.raises(SSDError, match="not empty"):
        restore_snapshot(tmp_path / "snap", tmp_path / "s")
    with pytest.raises(SSDError, match="not empty"):
        with SSDPS(tmp_path / "x", W) as x:
            x.dump(k[:1], rows_for(k[:1], 0))
            x.snapshot(tmp_path / "snap")  # a snapshot destination must be empty
    SSDPS.restore(tmp_path / "snap", tmp_path / "s", replace=True)
    assert sorted(os.listdir(tmp_path)) == ["s", "snap", "x"]  # no temporary directories left
    with SSDPS(tmp_path / "s") as s:
        rows, found = s.load(k)
        assert found.all() and np.array_equal(rows, rows_for(k, 1))


def test_snapshot_of_an_empty_store(tmp_path):
    with SSDPS(tmp_path / "s", W) as s:
        assert s.snapshot(tmp_path / "snap")["files"] == 0
    restore_snapshot(tmp_path / "snap", tmp_path / "r")
    with SSDPS(tmp_path / "r") as r:
        assert len(r) == 0 and r.width == W
