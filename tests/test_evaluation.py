"""When to evaluate while training, which evaluation is best, and when early stopping stops."""

from __future__ import annotations

import math

import pytest

from hpsray.evaluation import EvalPoint, EvalSettings, EvalTrack


def _point(batches: int, auc: float, logloss: float = 0.5) -> EvalPoint:
    return EvalPoint(batches, 0, auc, logloss, 100)


def test_an_evaluation_is_due_every_k_batches_of_a_pass():
    track = EvalTrack(EvalSettings(every_batches=3))
    assert [b for b in range(10) if track.due(b)] == [3, 6, 9]
    assert not any(EvalTrack(EvalSettings()).due(b) for b in range(10))  # pass ends only


def test_early_stopping_stops_after_patience_evaluations_without_improvement_and_keeps_the_best():
    track = EvalTrack(EvalSettings(every_batches=1, metric="auc", patience=2))
    assert track.record(_point(1, 0.70))
    assert track.record(_point(2, 0.72))
    assert not track.record(_point(3, 0.72))  # equal is no improvement
    assert not track.stop
    assert not track.record(_point(4, 0.71))
    assert track.stop
    assert track.best == _point(2, 0.72)
    assert track.as_dict()["stopped_early"] and len(track.as_dict()["points"]) == 4


def test_logloss_improves_downwards_and_nan_never_wins():
    track = EvalTrack(EvalSettings(metric="logloss", patience=1))
    assert track.record(_point(1, 0.7, logloss=math.nan))
    assert track.record(_point(2, 0.7, logloss=0.40))  # a number beats a nan
    assert not track.record(_point(3, 0.7, logloss=math.nan))
    assert track.stop
    track = EvalTrack(EvalSettings(metric="logloss"))
    assert track.record(_point(1, 0.7, logloss=0.50)) and track.record(_point(2, 0.7, logloss=0.45))
    assert not track.record(_point(3, 0.7, logloss=0.46)) and not track.stop  # no patience: never stops


def test_a_pass_end_that_was_also_due_is_recorded_once():
    track = EvalTrack(EvalSettings(every_batches=2))
    track.record(_point(4, 0.7))
    assert not track.record(_point(4, 0.7))
    assert len(track.points) == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"every_batches": -1}, "eval.every_batches"),
        ({"metric": "accuracy"}, "eval.early_stopping.metric"),
        ({"patience": 0}, "eval.early_stopping.patience"),
    ],
)
def test_bad_settings_name_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        EvalSettings(**settings)
