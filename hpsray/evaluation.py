"""Evaluation while training: when to evaluate, which evaluation is the best, when to stop.

One :class:`EvalTrack` per run, shared in meaning by the pipeline's driver and the reference job
(each evaluates its own model; this module decides nothing about how). An evaluation is due after
every ``every_batches`` batches of a pass and at each pass's end; with ``patience`` the run stops
once that many evaluations in a row have not improved on the best one, and the best model is the
one a run exports.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

METRICS = {"auc": 1.0, "logloss": -1.0}
"""Metrics early stopping may watch, with the sign that makes larger better."""


@dataclass(frozen=True)
class EvalSettings:
    """``[eval]`` of a job: ``every_batches`` (0: at pass ends only); early stopping on
    ``metric`` (``"auc"`` or ``"logloss"``) after ``patience`` evaluations without improvement
    (``None``: never stops early)."""

    every_batches: int = 0
    metric: str = "auc"
    patience: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every_batches, bool) or not isinstance(self.every_batches, int) or self.every_batches < 0:
            raise ValueError(f"eval.every_batches must be an integer >= 0, got {self.every_batches!r}")
        if self.metric not in METRICS:
            raise ValueError(f"eval.early_stopping.metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if self.patience is not None and (
            isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1
        ):
            raise ValueError(f"eval.early_stopping.patience must be an integer >= 1, got {self.patience!r}")


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation: after ``batches`` batches trained (counted from the run's start), in pass
    ``pass_index`` (from 0), over ``examples`` held-out examples, taking ``seconds``."""

    batches: int
    pass_index: int
    auc: float
    logloss: float
    examples: int
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalTrack:
    """The evaluations of a run so far and the decisions they lead to."""

    settings: EvalSettings
    points: list[EvalPoint] = field(default_factory=list)
    best: EvalPoint | None = None
    since_best: int = 0  # evaluations after the best one that did not improve on it

    def due(self, batches_in_pass: int) -> bool:
        """Whether an evaluation is due after ``batches_in_pass`` batches of the current pass
        (pass ends are due in any case: call :meth:`record` there)."""
        k = self.settings.every_batches
        return k > 0 and batches_in_pass > 0 and batches_in_pass % k == 0

    def record(self, point: EvalPoint) -> bool:
        """Add ``point``; returns whether it is the new best (the first one is). A second
        evaluation at the same batch count (a pass end that was also due) is ignored."""
        if self.points and self.points[-1].batches == point.batches:
            return False
        self.points.append(point)
        sign = METRICS[self.settings.metric]
        value = sign * getattr(point, self.settings.metric)
        best = None if self.best is None else sign * getattr(self.best, self.settings.metric)
        if best is None or (not math.isnan(value) and (math.isnan(best) or value > best)):
            self.best, self.since_best = point, 0
            return True
        self.since_best += 1
        return False

    @property
    def stop(self) -> bool:
        """Whether early stopping says to stop now."""
        p = self.settings.patience
        return p is not None and self.since_best >= p

    def as_dict(self) -> dict[str, Any]:
        """What the run report carries: every evaluation, the best and whether the run stopped early."""
        return {
            "points": [p.as_dict() for p in self.points],
            "best": self.best.as_dict() if self.best is not None else None,
            "stopped_early": self.stop,
            "metric": self.settings.metric,
        }
