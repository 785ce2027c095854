"""Checkpoints: atomic commit, pruning, what ``latest`` takes, skips and refuses."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle

import numpy as np
import pytest

from hpsray.checkpoint import Checkpoint, Checkpoints, job_fingerprint, node_dir
from hpsray.checkpoint.record import NAME, seal
from hpsray.errors import CheckpointError, CheckpointFullError, DiskFullError
from hpsray.tiers.ssd import SSDPS, restore_snapshot

FP = job_fingerprint({"dim": 8, "seed": 0})


def write(staging, batch: int, size: int = 1000) -> None:
    """What a job's writers would put in a checkpoint: a node's file and the driver's."""
    node = node_dir(staging, 0)
    node.mkdir()
    (node / "state.bin").write_bytes(bytes([batch % 256]) * size)
    (staging / "dense.pt").write_bytes(b"dense %d" % batch)


def commit(ckpts: Checkpoints, batch: int, fingerprint: str | None = FP) -> Checkpoint:
    staging = ckpts.stage(batch)
    write(staging, batch)
    return ckpts.commit(staging, batch, {"examples": batch * 10}, fingerprint=fingerprint)


def test_commit_records_every_file_and_latest_reads_it_back(tmp_path):
    ckpts = Checkpoints(tmp_path / "c")
    assert ckpts.latest(FP) is None  # no checkpoint at all: start from scratch
    c = commit(ckpts, 7)
    assert c.path == tmp_path / "c" / "ckpt-000007" and c.batch == 7 and c.meta == {"examples": 70}
    assert [(f["path"], f["size"], f["check"]) for f in c.files] == [
        ("dense.pt", 7, "crc32"),
        ("node-0/state.bin", 1000, "crc32"),
    ]
    record = json.loads((c.path / NAME).read_text())
    assert record["format"] == "hpsray-checkpoint" and record["version"] == 1 and record["fingerprint"] == FP
    latest = ckpts.latest(FP)
    assert latest is not None and latest.batch == 7 and latest.skipped == () and latest.meta == c.meta
    assert latest.node(0) == c.path / "node-0" and (latest.node(0) / "state.bin").read_bytes()[:1] == b"\x07"
    latest.verify(FP, deep=True)


def test_pruning_keeps_the_newest_and_removes_leftovers(tmp_path):
    ckpts = Checkpoints(tmp_path / "c", keep=2)
    leftover = tmp_path / "c" / ".ckpt-000002.tmp-0123abcd"  # a crash's half-written checkpoint
    leftover.mkdir(parents=True)
    (leftover / "dense.pt").write_bytes(b"half")
    for b in (1, 2, 3):
        commit(ckpts, b)
    assert sorted(os.listdir(tmp_path / "c")) == ["ckpt-000002", "ckpt-000003"]
    pending = ckpts.stage(4)  # staged, never committed: never taken for a checkpoint
    write(pending, 4)
    assert ckpts.latest(FP).batch == 3
    ckpts.abort(pending)
    assert not pending.exists()
    commit(ckpts, 3)  # the same batch again: replaced
    assert [p.name for p in ckpts.committed()] == ["ckpt-000003", "ckpt-000002"]
    commit(ckpts, 1)  # an earlier batch: the later ones belong to an abandoned run
    assert [p.name for p in ckpts.committed()] == ["ckpt-000001"]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda c: os.truncate(c / "node-0" / "state.bin", 10), "node-0/state.bin: size 10 bytes, recorded 1000"),
        (lambda c: (c / "dense.pt").write_bytes(b"dense 9"), "dense.pt: crc32 mismatch"),
        (lambda c: os.remove(c / "dense.pt"), "dense.pt: missing"),
        (lambda c: (c / "node-0" / "extra").write_bytes(b"?"), "node-0/extra: not recorded in CHECKPOINT.json"),
        (lambda c: os.remove(c / NAME), "no CHECKPOINT.json: not a whole checkpoint"),
        (lambda c: (c / NAME).write_text((c / NAME).read_text().replace('"batch": 3', '"batch": 4')), "checksum"),
    ],
    ids=["truncated", "checksum", "missing", "unrecorded", "no-record", "record-edited"],
)
def test_a_damaged_newest_is_skipped_for_a_verified_older_one(tmp_path, caplog, damage, reason):
    ckpts = Checkpoints(tmp_path / "c")
    commit(ckpts, 2)
    newest = commit(ckpts, 3).path
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="hpsray.checkpoint"):
        got = ckpts.latest(FP)
    assert got.batch == 2
    assert len(got.skipped) == 1 and str(newest) in got.skipped[0] and reason in got.skipped[0]
    assert reason in caplog.text and "resuming from" in caplog.text


def test_no_verified_checkpoint_is_an_error_naming_each(tmp_path):
    ckpts = Checkpoints(tmp_path / "c")
    a, b = commit(ckpts, 2).path, commit(ckpts, 3).path
    os.truncate(a / "dense.pt", 1)
    os.remove(b / "dense.pt")
    with pytest.raises(CheckpointError, match="no checkpoint verifies") as e:
        ckpts.latest(FP)
    assert f"{b}: dense.pt: missing" in str(e.value) and f"{a}: dense.pt: size 1 bytes" in str(e.value)


def test_another_jobs_checkpoint_is_refused_with_the_reason(tmp_path):
    ckpts = Checkpoints(tmp_path / "c")
    commit(ckpts, 3, fingerprint="other-job")
    with pytest.raises(CheckpointError, match=r"ckpt-000003: written by another job \(fingerprint 'other-job'"):
        ckpts.latest(FP)
    assert ckpts.latest("other-job").batch == 3 and ckpts.latest().batch == 3  # no fingerprint: not checked
    staging = ckpts.stage(4)
    with pytest.raises(CheckpointError, match="holds checkpoints of another job"):
        ckpts.commit(staging, 4, fingerprint=FP)  # would prune the other job's
    assert not staging.exists() and [p.name for p in ckpts.committed()] == ["ckpt-000003"]


def test_an_unknown_format_version_is_refused(tmp_path):
    ckpts = Checkpoints(tmp_path / "c")
    c = commit(ckpts, 3)
    record = json.loads((c.path / NAME).read_text())
    del record["crc32"]
    record["version"] = 99
    (c.path / NAME).write_bytes(seal(record))
    with pytest.raises(CheckpointError, match="format 'hpsray-checkpoint' version 99, this build reads"):
        Checkpoint.open(c.path)


def test_commit_checks_its_arguments_and_cleans_up(tmp_path):
    ckpts = Checkpoints(tmp_path / "c")
    with pytest.raises(CheckpointError, match="not a staging directory"):
        ckpts.commit(tmp_path, 1)
    staging = ckpts.stage(1)
    with pytest.raises(CheckpointError, match="not a staging directory"):
        ckpts.commit(staging, 2)  # staged for batch 1
    with pytest.raises(CheckpointError, match="meta is not JSON-able"):
        ckpts.commit(staging, 1, {"x": object()})
    assert not staging.exists() and ckpts.committed() == []
    with pytest.raises(ValueError):
        Checkpoints(tmp_path / "d", keep=0)


class _Wrapper(Exception):
    """Like Ray's RayTaskError: the original error under ``.cause``."""

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "ray-wrapped"])
def test_staged_removes_the_staging_and_names_a_full_disk(tmp_path, wrap):
    ckpts = Checkpoints(tmp_path / "c")
    commit(ckpts, 1)
    with pytest.raises(CheckpointFullError) as e:
        with ckpts.staged(2) as staging:
            (staging / "dense.pt").write_bytes(b"x" * 5000)
            full = OSError(errno.ENOSPC, "No space left on device")
            raise _Wrapper(full) if wrap else full
    err = e.value
    assert isinstance(err, DiskFullError) and isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert err.directory == str(tmp_path / "c") and err.needed == 5000 and err.free is not None
    assert f"checkpoint directory {tmp_path / 'c'}: no space left for the checkpoint of batch 2" in str(err)
    assert "more than 5000 bytes" in str(err) and "ckpt-000001 stays the latest checkpoint" in str(err)
    assert not staging.exists() and ckpts.latest(FP).batch == 1
    with pytest.raises(KeyError):  # other errors go through as they are
        with ckpts.staged(2) as staging:
            raise KeyError("x")
    assert not staging.exists()
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is CheckpointFullError and str(back) == str(err) and back.needed == 5000


def test_a_checkpoint_holding_an_ssd_snapshot(tmp_path, ssd_warm):
    """The pipeline's use: each node's SSD-PS snapshot in node-i/, the driver's files beside."""
    k = np.arange(100, dtype=np.uint64)
    rows = np.repeat(k[:, None].astype(np.float32), 4, axis=1)
    ckpts = Checkpoints(tmp_path / "c")
    with SSDPS(tmp_path / "ssd", 4, rows_per_file=16) as s:
        s.dump(k, rows)
        with ckpts.staged(5) as staging:
            s.snapshot(node_dir(staging, 0) / "ssd")
            (staging / "dense.pt").write_bytes(b"dense")
            c = ckpts.commit(staging, 5, fingerprint=FP)
        s.dump(k, rows + 1)
        s.compact(full=True)  # the store moves on; the checkpoint's links keep the old files
    checks = {f["path"].rsplit("/", 1)[-1]: f["check"] for f in c.files}
    assert checks.pop("MANIFEST") == checks.pop("SNAPSHOT.json") == checks.pop("dense.pt") == "crc32"
    assert len(checks) == 7 and set(checks.values()) == {"param"}
    latest = ckpts.latest(FP, deep=True)
    restore_snapshot(latest.node(0) / "ssd", tmp_path / "restored")
    with SSDPS(tmp_path / "restored") as r:
        got, found = r.load(k)
        assert found.all() and np.array_equal(got, rows)
    hps = sorted((latest.node(0) / "ssd").glob("*.hps"))[3]
    os.truncate(hps, 100)
    with pytest.raises(CheckpointError, match=rf"node-0/ssd/{hps.name}: size 100 bytes, recorded"):
        latest.verify(FP)


def test_checkpoint_errors_survive_pickling():
    e = CheckpointError("/ckpt/ckpt-000003", "dense.pt: missing")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is CheckpointError and str(back) == "/ckpt/ckpt-000003: dense.pt: missing"
    assert back.path == "/ckpt/ckpt-000003" and back.reason == "dense.pt: missing"
    assert job_fingerprint({"a": 1, "b": [2]}) == job_fingerprint({"b": [2], "a": 1}) != job_fingerprint({"a": 2})
