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
