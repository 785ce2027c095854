"""Checkpoints in object storage (hpsray/checkpoint/remote.py; issue 45) against a real S3
server started here (moto's server mode, over HTTP through pyarrow's S3 client): each parameter
file uploaded once, the manifest as the commit, reference-counted keeping, resuming with an
empty local disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpsray.checkpoint import job_fingerprint, node_dir
from hpsray.checkpoint.remote import RemoteCheckpoints, open_checkpoints
from hpsray.errors import CheckpointError
from hpsray.tiers.ssd import SSDPS, restore_snapshot

FP = job_fingerprint({"remote": 1})


def _remote(uri: str, cache, keep: int = 2) -> RemoteCheckpoints:
    ckpts = open_checkpoints(uri, keep) if cache is None else RemoteCheckpoints(uri, keep, cache=cache)
    assert isinstance(ckpts, RemoteCheckpoints)
    ckpts.fs.create_dir(ckpts.root.split("/")[0])
    return ckpts


def _checkpoint(ckpts, store, batch: int):
    with ckpts.staged(batch) as staging:
        store.snapshot(node_dir(staging, 0) / "ssd")
        (staging / "dense.pt").write_bytes(b"dense %d" % batch)
        return ckpts.commit(staging, batch, {"examples": batch}, fingerprint=FP)


def test_parameter_files_upload_once_and_a_fresh_host_resumes(s3_uri, tmp_path, ssd_warm):
    k = np.arange(200, dtype=np.uint64)
    rows = np.repeat(k[:, None].astype(np.float32), 4, axis=1)
    ckpts = _remote(s3_uri, tmp_path / "cache-a")
    with SSDPS(tmp_path / "ssd", 4, rows_per_file=32, background=False) as s:
        s.dump(k, rows)
        c1 = _checkpoint(ckpts, s, 1)
        first = dict(ckpts.last_upload)
        _checkpoint(ckpts, s, 2)  # nothing changed: only the small files go up again
        second = dict(ckpts.last_upload)
        s.dump(k[:10], rows[:10] + 1)  # one new parameter file
        _checkpoint(ckpts, s, 3)
        third = dict(ckpts.last_upload)
    assert first["reused"] == 0 and first["bytes"] == sum(f["size"] for f in c1.files)
    assert second["reused"] == first["files"] - 3 and second["bytes"] < 1000  # MANIFEST, SNAPSHOT.json, dense.pt
    assert third["reused"] == second["reused"] and third["files"] == 4
    assert sorted(p.name for p in (tmp_path / "cache-a").iterdir()) == ["ckpt-000002", "ckpt-000003"]  # kept: 2
    listed = ckpts._list("")
    assert sorted(k for k in listed if "/" not in k) == ["ckpt-000002.json", "ckpt-000003.json"]
    assert not any(k.startswith("data/ckpt-000001/") for k in listed)  # collected with its manifest
    kept = [
        json.loads(ckpts.fs.open_input_stream(ckpts._key(m)).read()) for m in ("ckpt-000002.json", "ckpt-000003.json")
    ]
    referenced = {o for m in kept for o in m["objects"].values()}
    assert set(listed) - {"ckpt-000002.json", "ckpt-000003.json"} == referenced  # nothing unreferenced is left
    # a host with empty disks: another cache, no store directory
    fresh = _remote(s3_uri, tmp_path / "cache-b")
    assert [p.name for p in fresh.committed()] == ["ckpt-000003", "ckpt-000002"]
    latest = fresh.latest(FP, deep=True)
    assert latest is not None and latest.batch == 3 and latest.meta == {"examples": 3}
    assert str(latest.path).startswith(str(tmp_path / "cache-b"))
    restore_snapshot(latest.node(0) / "ssd", tmp_path / "restored")
    with SSDPS(tmp_path / "restored") as r:
        got, found = r.load(k)
    expected = rows.copy()
    expected[:10] += 1
    assert found.all() and np.array_equal(got, expected)
    with pytest.raises(CheckpointError, match="another job"):
        fresh.latest(job_fingerprint({"other": 1}))


def test_the_manifest_commits_and_a_missing_object_falls_back_to_the_older(s3_uri, tmp_path, ssd_warm):
    k = np.arange(50, dtype=np.uint64)
    ckpts = _remote(s3_uri, tmp_path / "cache-a", keep=3)
    with SSDPS(tmp_path / "ssd", 2, rows_per_file=16, background=False) as s:
        s.dump(k, np.ones((50, 2), np.float32))
        _checkpoint(ckpts, s, 1)
        s.dump(k, np.full((50, 2), 2, np.float32))
        c2 = _checkpoint(ckpts, s, 2)
    # objects of a checkpoint whose manifest never came (a crash before the commit) are not a checkpoint
    ckpts._put_bytes(b"half", "data/ckpt-000004/dense.pt")
    fresh = _remote(s3_uri, tmp_path / "cache-b")
    assert fresh.latest(FP).batch == 2
    # damage: an object the newest manifest references is gone
    manifest = json.loads(ckpts.fs.open_input_stream(ckpts._key("ckpt-000002.json")).read())
    param = next(o for o in manifest["objects"].values() if o.startswith("params/") and o not in _objects(ckpts, 1))
    ckpts.fs.delete_file(ckpts._key(param))
    other = _remote(s3_uri, tmp_path / "cache-c")
    got = other.latest(FP)
    assert got.batch == 1 and len(got.skipped) == 1 and "missing" in got.skipped[0] and param in got.skipped[0]
    assert c2.batch == 2


def _objects(ckpts: RemoteCheckpoints, batch: int) -> set[str]:
    m = json.loads(ckpts.fs.open_input_stream(ckpts._key(f"ckpt-{batch:06d}.json")).read())
    return set(m["objects"].values())


def test_a_local_directory_stays_local(tmp_path):
    from hpsray.checkpoint import Checkpoints

    assert type(open_checkpoints(tmp_path / "c")) is Checkpoints
    assert type(open_checkpoints(f"file://{tmp_path}/c")) is Checkpoints


# -- a job: checkpoints to s3://, the local disks lost, resumed -----------------------------------


@pytest.mark.slow
def test_a_job_checkpointed_to_s3_resumes_on_empty_local_disks_equal_to_the_reference(
    ray_local, s3_uri, tmp_path, monkeypatch
):
    import shutil
    import threading
    import time

    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import (
        CheckpointSettings,
        MemPSSettings,
        Pipeline,
        SSDPSSettings,
        SyntheticSource,
        TrainerSettings,
    )
    from hpsray.reference import ReferenceTrainer

    source = SyntheticSource(PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=3, seed=5), rows=12000)
    batch, cfg = 500, TrainConfig(dim=4, hidden=(8,), minibatch_size=250, sparse_optimizer="adagrad", sparse_lr=0.05)
    ref = ReferenceTrainer(source.n_slots, source.n_dense, cfg)
    ref.fit(source.open(batch))
    ref_keys, ref_rows, ref_dense = ref.export()

    monkeypatch.setenv("HPSRAY_CHECKPOINT_CACHE", str(tmp_path / "cache"))
    _remote(s3_uri, None)  # the bucket
    stages = (TrainerSettings(cfg), MemPSSettings(capacity_rows=1500), SSDPSSettings(str(tmp_path / "ssd")))
    with Pipeline(source, *stages, batch_size=batch, checkpoint=CheckpointSettings(s3_uri, every_batches=3)) as p:

        def stop_after_a_checkpoint() -> None:
            while (p._checkpointed or 0) < 6:
                time.sleep(0.05)
            p.interrupt()  # as the first Ctrl-C does: stop, checkpoint, at the next batch end

        threading.Thread(target=stop_after_a_checkpoint, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            p.fit(progress=False)
        stopped = p._checkpointed
        upload = dict(p._checkpoints.last_upload)
    assert 6 < stopped < 24 and upload["files"] >= 1
    shutil.rmtree(tmp_path / "ssd")  # every local disk lost: the store and the checkpoint cache
    shutil.rmtree(tmp_path / "cache")
    resumed = CheckpointSettings(s3_uri, every_batches=10, resume=True)
    with Pipeline(source, *stages, batch_size=batch, checkpoint=resumed) as p:
        report = p.fit(progress=False)
        assert report["batches"] == 24 - stopped
        keys, rows = p.export_rows()
        dense = p.dense_state()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_node_whose_files_are_not_on_the_driver_host_stops_the_commit(s3_uri, tmp_path):
    ckpts = _remote(s3_uri, tmp_path / "cache")
    staging = ckpts.stage(4)
    node_dir(staging, 0).mkdir()
    (node_dir(staging, 0) / "state.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="node 1's files are neither uploaded by that node nor on"):
        ckpts.commit(staging, 4, {"nodes": 2}, fingerprint=FP)
    assert ckpts.committed() == [] and not staging.exists()


def test_clearing_removes_every_checkpoint_and_object(s3_uri, tmp_path, ssd_warm):
    from hpsray.pipelines.preflight import clear_checkpoints

    ckpts = _remote(s3_uri, tmp_path / "cache")
    with SSDPS(tmp_path / "ssd", 2, rows_per_file=16, background=False) as s:
        s.dump(np.arange(40, dtype=np.uint64), np.ones((40, 2), np.float32))
        _checkpoint(ckpts, s, 1)
        _checkpoint(ckpts, s, 2)
    assert len(ckpts._list("")) > 2
    monkey = pytest.MonkeyPatch()
    monkey.setenv("HPSRAY_CHECKPOINT_CACHE", str(tmp_path / "cache2"))
    try:
        assert clear_checkpoints(s3_uri) == ["ckpt-000002", "ckpt-000001"]
    finally:
        monkey.undo()
    assert ckpts._list("") == {} and ckpts.latest(FP) is None


def test_the_cache_follows_the_store(s3_uri, tmp_path, ssd_warm):
    """A checkpoint removed from the store (by hand, or another job's that was there) is dropped
    from the cache at the next commit: it neither blocks the commit as another job's nor resumes."""
    ckpts = _remote(s3_uri, tmp_path / "cache")
    with SSDPS(tmp_path / "ssd", 2, rows_per_file=16, background=False) as s:
        s.dump(np.arange(40, dtype=np.uint64), np.ones((40, 2), np.float32))
        _checkpoint(ckpts, s, 1)
        for key in ckpts._list(""):
            ckpts.fs.delete_file(ckpts._key(key))  # the bucket emptied by hand
        other = RemoteCheckpoints(s3_uri, 2, cache=tmp_path / "cache")
        with other.staged(2) as staging:
            s.snapshot(node_dir(staging, 0) / "ssd")
            other.commit(staging, 2, fingerprint=job_fingerprint({"another": "job"}))
    assert [p.name for p in other.committed()] == ["ckpt-000002"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["ckpt-000002"]


# -- several hosts: each node uploads its own files, a host fetches only its shard ----------------


def test_each_node_uploads_its_files_and_a_host_with_empty_disks_fetches_its_shard(s3_uri, tmp_path, ssd_warm):
    """Node 0 stages on the driver's host, node 1 on another (the same staging path there is
    another directory): each uploads its own files, the driver commits with the manifest; a
    fresh driver downloads and verifies the whole checkpoint, a fresh host fetches node 1's only."""
    from hpsray.checkpoint.remote import HOST_MARK, fetch_node, upload_node

    ckpts = _remote(s3_uri, tmp_path / "driver")
    staging = ckpts.stage(5)
    (staging / "dense.pt").write_bytes(b"dense")
    other_host = tmp_path / "host-b" / staging.name  # node 1's view of the staging path
    k = np.arange(300, dtype=np.uint64)
    rows = np.repeat(k[:, None].astype(np.float32), 2, axis=1)
    for node, root in ((0, staging), (1, other_host)):
        with SSDPS(tmp_path / f"ssd-{node}", 2, rows_per_file=64, background=False) as s:
            mine = k[k % 2 == node]
            s.dump(mine, rows[mine.astype(np.int64)])
            s.snapshot(node_dir(root, node) / "ssd")
        (node_dir(root, node) / "trainer.pt").write_bytes(b"state %d" % node)
    (staging / HOST_MARK).write_text("token")
    up0 = upload_node(ckpts.location, staging, 0, "token")
    up1 = upload_node(ckpts.location, other_host, 1, "token")
    assert node_dir(staging, 0).is_dir() and not other_host.exists()  # the other host keeps nothing
    (staging / HOST_MARK).unlink()
    ckpts.commit(staging, 5, {"nodes": 2}, fingerprint=FP, uploaded=[up0, up1])
    sent = ckpts.last_upload
    assert sent["driver"] == {"bytes": 5, "files": 1, "reused": 0, "reused_bytes": 0}  # dense.pt only
    node1_bytes = sum(e["size"] for e in up1["entries"])
    assert sent["nodes"][1]["bytes"] == node1_bytes and sent["bytes"] == 5 + up0["sent"]["bytes"] + node1_bytes
    # the driver's cache lacks node 1's files: its latest() fetches them and verifies the whole
    got = ckpts.latest(FP, deep=True)
    assert got is not None and (got.node(1) / "trainer.pt").read_bytes() == b"state 1"
    fresh = _remote(s3_uri, tmp_path / "fresh-driver")
    latest = fresh.latest(FP, deep=True)
    assert latest is not None and latest.batch == 5
    plan = {**fresh.shard_plan(latest), "path": str(tmp_path / "host-c" / "ckpt-000005")}
    assert fetch_node(plan, 1) == {"bytes": node1_bytes, "files": len(up1["entries"])}
    assert sorted(p.name for p in (tmp_path / "host-c" / "ckpt-000005").iterdir()) == ["node-1"]
    assert fetch_node(plan, 1) == {"bytes": 0, "files": 0}  # present: nothing downloaded again
    restore_snapshot(tmp_path / "host-c" / "ckpt-000005" / "node-1" / "ssd", tmp_path / "restored")
    with SSDPS(tmp_path / "restored") as r:
        back, found = r.load(k[k % 2 == 1])
    assert found.all() and np.array_equal(back, rows[1::2])
    # a node neither uploaded nor on the driver's host stops the commit
    staging = ckpts.stage(6)
    with pytest.raises(CheckpointError, match="node 1's files are neither uploaded"):
        ckpts.commit(staging, 6, {"nodes": 2}, fingerprint=FP, uploaded=[up0])


def test_an_upload_the_store_does_not_keep_as_sent_fails_the_checkpoint(s3_uri, tmp_path, ssd_warm):
    """A host without credentials uploads unsigned; moto keeps such a body aws-chunked, 52 bytes
    longer than the file (found as a checkpoint that never verified again). The commit checks
    the size the store holds and fails naming the object, instead of committing a checkpoint
    that cannot be restored."""
    ckpts = _remote(s3_uri, tmp_path / "cache")
    with SSDPS(tmp_path / "ssd", 4, rows_per_file=32, background=False) as s:
        s.dump(np.arange(100, dtype=np.uint64), np.ones((100, 4), np.float32))
        with ckpts.staged(1) as staging:
            s.snapshot(node_dir(staging, 0) / "ssd")
            code = (
                "import sys; from hpsray.checkpoint.remote import upload_node; upload_node(sys.argv[1], sys.argv[2], 0)"
            )
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            done = subprocess.run(
                [sys.executable, "-c", code, s3_uri, str(staging)], env=env, capture_output=True, text=True
            )
            ckpts.abort(staging)
    assert done.returncode != 0
    assert "CheckpointError" in done.stderr and "params/" in done.stderr and "the store holds" in done.stderr
    assert not ckpts._list("params/")  # the bad object was deleted
    assert ckpts.latest(FP) is None  # nothing committed
