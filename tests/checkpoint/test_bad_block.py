"""Rows that survive a bad disk (issue 45): a byte flipped in the live parameter files mid-run.
With checkpoints in object storage (a moto S3 server here), or on another file system (copies),
the job restores the damaged files from there, replays from the checkpoint and ends equal to the
reference; with local checkpoints on the same file system (hard links to the same damaged files)
it stops naming the file and the rows at stake."""

from __future__ import annotations

import glob
import os
import threading
import time

import numpy as np
import pytest
from test_remote import _remote  # tests/checkpoint/test_remote.py

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.errors import CorruptFileError, TrainingStopped, caused_by
from hpsray.pipelines import (
    CheckpointSettings,
    MemPSSettings,
    Pipeline,
    SSDPSSettings,
    SyntheticSource,
    TrainerSettings,
)
from hpsray.reference import ReferenceTrainer
from hpsray.tiers.ssd.paramfile import HEADER_BYTES, decode_header

SOURCE = SyntheticSource(PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=3, seed=5), rows=12000)
BATCH = 500
CFG = TrainConfig(dim=4, hidden=(8,), minibatch_size=250, sparse_optimizer="adagrad", sparse_lr=0.05)
NO_COMPACTION = {"background": False, "compact_trigger": 1000.0, "max_space_ratio": None}


def flip_a_byte_in_every_file(ssd_dir) -> list[str]:
    """Flip one byte in the rows of every live parameter file, in place (as a bad sector: every
    hard link to the file sees it); returns the files."""
    files = sorted(glob.glob(os.path.join(ssd_dir, "**", "*.hps"), recursive=True))
    for path in files:
        with open(path, "r+b") as f:
            h = decode_header(np.frombuffer(f.read(HEADER_BYTES), np.uint8), path)
            at = HEADER_BYTES + 16 * h.n + (h.n * h.width * 4) // 2
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
    return files


def _run_with_a_flip(tmp_path, checkpoint_dir: str) -> tuple[Pipeline, list[str], dict | BaseException]:
    stages = (
        TrainerSettings(CFG),
        MemPSSettings(capacity_rows=1500),
        SSDPSSettings(str(tmp_path / "ssd"), options=NO_COMPACTION),
    )
    flipped: list[str] = []
    with Pipeline(
        SOURCE, *stages, batch_size=BATCH, checkpoint=CheckpointSettings(checkpoint_dir, every_batches=4)
    ) as p:

        def flip_after_a_checkpoint() -> None:
            while (p._checkpointed or 0) < 8:
                time.sleep(0.02)
            flipped.extend(flip_a_byte_in_every_file(tmp_path / "ssd"))

        threading.Thread(target=flip_after_a_checkpoint, daemon=True).start()
        try:
            result: dict | BaseException = p.fit(progress=False)
            keys, rows = p.export_rows()
            result = {"report": result, "keys": keys, "rows": rows, "dense": p.dense_state()}
        except TrainingStopped as e:
            result = e
    return p, flipped, result


@pytest.mark.slow
def test_a_damaged_file_is_fetched_again_from_object_storage_and_the_job_ends_equal(
    ray_local, s3_uri, tmp_path, monkeypatch
):
    monkeypatch.setenv("HPSRAY_CHECKPOINT_CACHE", str(tmp_path / "cache"))
    _remote(s3_uri, None)  # the bucket
    _, flipped, result = _run_with_a_flip(tmp_path, s3_uri)
    assert flipped and isinstance(result, dict), result
    recoveries = result["report"]["recovery"]
    assert len(recoveries) == 1 and "CorruptFileError" in recoveries[0]["error"] and recoveries[0]["dead"] == []
    assert_equal_to_the_reference(result)


def assert_equal_to_the_reference(result: dict) -> None:
    ref = ReferenceTrainer(SOURCE.n_slots, SOURCE.n_dense, CFG)
    ref.fit(SOURCE.open(BATCH))
    ref_keys, ref_rows, ref_dense = ref.export()
    np.testing.assert_array_equal(result["keys"], ref_keys)
    np.testing.assert_allclose(result["rows"], ref_rows, rtol=1e-5, atol=1e-5)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(result["dense"][name].numpy(), value.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_without_a_durable_copy_the_job_stops_naming_the_file_and_the_rows(ray_local, tmp_path):
    _, flipped, result = _run_with_a_flip(tmp_path, str(tmp_path / "ckpt"))
    assert flipped and isinstance(result, TrainingStopped), result
    assert caused_by(result, CorruptFileError) or "CorruptFileError" in str(result)
    message = str(result)
    assert any(os.path.basename(f) in message for f in flipped) and "at stake" in message, message


@pytest.mark.slow
def test_checkpoints_on_another_file_system_are_copies_and_restore_the_damaged_file(ray_local, tmp_path, tmpfs):
    """A local ``[checkpoint] dir`` on another disk (a tmpfs here) holds copies, not links: the
    job restores from it and ends equal to the reference."""
    _, flipped, result = _run_with_a_flip(tmp_path, str(tmpfs("256m") / "ckpt"))
    assert flipped and isinstance(result, dict), result
    recoveries = result["report"]["recovery"]
    assert len(recoveries) == 1 and "CorruptFileError" in recoveries[0]["error"]
    assert_equal_to_the_reference(result)
