"""Checkpoints in object storage on a multi-node Ray cluster (simulated on this machine; issue
45): each node uploads its own files to a real S3 server (moto), the driver writes the manifest;
every node's SSD-PS directory and the checkpoint cache are deleted, and the job resumes from
``s3://`` on the same shape and on another one, equal to the reference of that history (an
uninterrupted run: same batches, same order). About 40 s per case on 2 busy cores."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from s3_server import moto_s3, s3_uri  # tests/s3_server.py
from test_elastic_shape import BATCH, CFG, SOURCE, at_batch_end, reference_across, stored_rows_by_node

from hpsray.checkpoint.remote import RemoteCheckpoints
from hpsray.pipelines import CheckpointSettings, MemPSSettings, Pipeline, SSDPSSettings, TrainerSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_before_cluster():
    """The S3 server, started before the cluster so that its nodes inherit the credentials."""
    with moto_s3() as server:
        yield server


def pipeline(uri: str, ssd: str, nodes: int, resume: bool = False) -> Pipeline:
    return Pipeline(
        SOURCE,
        TrainerSettings(CFG),
        MemPSSettings(capacity_rows=700),
        SSDPSSettings(ssd, options=dict(rows_per_file=128)),
        batch_size=BATCH,
        nodes=nodes,
        checkpoint=CheckpointSettings(uri, every_batches=1, resume=resume),
    )


@pytest.mark.parametrize("new", [2, 1])
def test_lost_local_disks_resume_from_s3_equal_to_an_uninterrupted_run(
    s3_before_cluster, two_nodes_cluster, tmp_path, monkeypatch, new
):
    uri = s3_uri(*s3_before_cluster, f"cluster-{new}")
    monkeypatch.setenv("HPSRAY_CHECKPOINT_CACHE", str(tmp_path / "cache"))
    with pipeline(uri, str(tmp_path / "ssd"), 2) as p:
        at_batch_end(p, 1, p.interrupt)  # as Ctrl-C: checkpoint, stop
        with pytest.raises(KeyboardInterrupt):
            p.fit(progress=False)
        checkpoints = p._checkpoints
        assert isinstance(checkpoints, RemoteCheckpoints)
        upload = checkpoints.last_upload
        k = p._checkpointed
    # each node sent its own files; the driver, whose staging holds no file of its own, none
    assert sorted(upload["nodes"]) == [0, 1] and all(upload["nodes"][i]["bytes"] > 0 for i in (0, 1))
    assert upload["driver"]["files"] == 0 and upload["bytes"] == sum(upload["nodes"][i]["bytes"] for i in (0, 1))
    assert upload["reused"] > 0  # parameter files unchanged since the previous checkpoint are referenced
    manifest = json.loads(checkpoints.fs.open_input_stream(checkpoints._key(f"ckpt-{k:06d}.json")).read())
    assert {rel.split("/")[0] for rel in manifest["objects"]} == {"node-0", "node-1"}
    shutil.rmtree(tmp_path / "ssd")  # every node's local disk lost, and the driver's cache
    shutil.rmtree(tmp_path / "cache")
    with pipeline(uri, str(tmp_path / "ssd"), new, resume=True) as p:
        report = p.fit(progress=False)
        assert len(p._nodes) == new and (report.get("reshaped") is None) == (new == 2)
        keys, rows = p.export_rows()
        dense = p.dense_state()
        stored = stored_rows_by_node(p)
    ref_keys, ref_rows, ref_dense = reference_across([(2, k), (new, 10**9)])
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(rows, ref_rows)
    for name, value in ref_dense.items():
        np.testing.assert_array_equal(dense[name].numpy(), value.numpy(), err_msg=name)
    assert sum(len(k_) for k_, _ in stored.values()) == len(ref_keys)
