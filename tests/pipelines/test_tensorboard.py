"""TensorBoard scalars are written where ``tensorboard --logdir`` reads them."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from hpsray.pipelines.tensorboard import SCALARS, TensorBoardLog  # noqa: E402


def test_every_scalar_reads_back_at_its_step(tmp_path):
    log = TensorBoardLog(str(tmp_path))
    for step in (1, 2, 5):
        assert log.add(step, {name: step * (i + 1) for i, name in enumerate(SCALARS)}) == len(SCALARS)
    assert log.add(6, {"eval/auc": None, "train/loss": math.nan}) == 0  # no value: no point
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(SCALARS)
    for i, name in enumerate(SCALARS):
        assert [(e.step, e.value) for e in events.Scalars(name)] == [(s, pytest.approx(s * (i + 1))) for s in (1, 2, 5)]


def test_a_misspelled_scalar_is_refused(tmp_path):
    log = TensorBoardLog(str(tmp_path))
    with pytest.raises(ValueError, match="unknown scalar 'train/los'"):
        log.add(1, {"train/los": 0.5})
    log.close()


def test_a_job_with_tensorboard_writes_every_scalar_and_its_progress_lines_carry_loss_and_eval(
    ray_local, tmp_path, caplog
):
    import logging

    from hpsray.job import JobConfig, build

    board = tmp_path / "tb"
    job = JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 2000, "eval_rows": 500, "slots": 4, "keys": 3000, "dense": 3, "seed": 1}},
            "model": {"dim": 4, "hidden": [8]},
            "tiers": {"mem_rows": 1500, "ssd": {"rows_per_file": 256}},
            "pipeline": {"batch_size": 250, "minibatch_size": 125, "progress_seconds": 0.001},
            "eval": {"every_batches": 3},
            "report": {"tensorboard": str(board)},
            "cluster": {"nodes": 1},
        },
        where=str(tmp_path / "job.toml"),
    )
    with caplog.at_level(logging.INFO, logger="hpsray.progress"), build.pipeline(job) as pipe:
        pipe.fit(progress=True)  # no terminal under pytest: progress goes to log lines
    events = EventAccumulator(str(board))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(SCALARS)
    assert [e.step for e in events.Scalars("eval/auc")] == [3, 6, 8]  # every 3 batches and the pass end
    assert all(0 < e.value < 5 for e in events.Scalars("train/loss"))
    lines = [r.getMessage() for r in caplog.records if r.name == "hpsray.progress"]
    assert any(" loss 0." in line for line in lines), lines
    assert any("eval AUC 0." in line and "(batch 3)" in line for line in lines), lines
