"""Run inside a namespace host (tests/hosts/test_s3_checkpoints.py): ``python s3_resume_driver.py URI
SSD_DIR CACHE``. A 2-node job checkpoints to ``URI`` and stops after batch 1; every node's SSD-PS
directory and the checkpoint cache are deleted; the job resumes from ``URI`` on 2 nodes and must
end equal to the reference of an uninterrupted run. Prints one JSON line: each node's upload."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(uri: str, ssd: str, cache: str) -> dict:
    import pyarrow.fs as pafs
    import ray
    from test_elastic_shape import at_batch_end, reference_across
    from test_remote_checkpoint_cluster import pipeline  # tests/cluster

    os.environ["HPSRAY_CHECKPOINT_CACHE"] = cache
    fs, path = pafs.FileSystem.from_uri(uri)
    fs.create_dir(path.split("/")[0])
    with pipeline(uri, ssd, 2) as p:
        at_batch_end(p, 1, p.interrupt)
        sent: list[dict] = []
        checkpoint = p._checkpoint

        def recorded(batch: int) -> None:
            checkpoint(batch)
            sent.append({"batch": batch, **p._checkpoints.last_upload})

        p._checkpoint = recorded
        try:
            p.fit(progress=False)
            raise AssertionError("the job was not interrupted")
        except KeyboardInterrupt:
            pass
        upload, k = p._checkpoints.last_upload, p._checkpointed
        ips = ray.get([n.ssd.__ray_call__.remote(lambda _: ray.util.get_node_ip_address()) for n in p._nodes])
    assert len(set(ips)) == 2, ips  # two hosts, each uploading its own files
    assert sorted(upload["nodes"]) == [0, 1] and upload["driver"]["files"] == 0, upload
    shutil.rmtree(ssd)
    shutil.rmtree(cache)
    with pipeline(uri, ssd, 2, resume=True) as p:
        p.fit(progress=False)
        keys, rows = p.export_rows()
        dense = p.dense_state()
    ref_keys, ref_rows, ref_dense = reference_across([(2, k), (2, 10**9)])
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(rows, ref_rows)
    for name, value in ref_dense.items():
        np.testing.assert_array_equal(dense[name].numpy(), value.numpy(), err_msg=name)
    per_checkpoint = [
        {"batch": u["batch"], **{f"n{i}": [v["bytes"], v["files"], v["reused_bytes"]] for i, v in u["nodes"].items()}}
        for u in sent
    ]  # per node: [bytes sent, files sent, bytes referenced again]
    return {"batch": k, "ips": ips, "nodes": {str(i): v for i, v in upload["nodes"].items()}, "sent": per_checkpoint}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
