"""Passes and evaluation while training, on the pipeline's driver, and where a run stops early
(early stopping, a Ctrl-C); docs/operations.md: Passes and evaluation.

:class:`Evaluations` is what :class:`~hpsray.pipelines.Pipeline` consults after each batch and
each pass: an :class:`~hpsray.evaluation.EvalTrack` over the held-out source, the best model so
far, and whether early stopping says to stop (the pipeline ends the pass there). An evaluation
waits for the batch's write-backs and the trainers' kept rows (as a checkpoint does), then scores
the owners' rows; the stages stay idle for that long and no longer.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from hpsray.evaluation import EvalPoint, EvalSettings, EvalTrack
from hpsray.fileio import replacing
from hpsray.models.metrics import auc, logloss
from hpsray.pipelines.placement import NodeActors, start_reader
from hpsray.pipelines.views import Evaluated

if TYPE_CHECKING:
    from hpsray.pipelines.sources import PipelineSource
    from hpsray.pipelines.tensorboard import TensorBoardLog

BEST = "best"
"""The folder, under ``[checkpoint] dir``, that holds the best model as an export."""


def check_passes(passes: int, evaluation: EvalSettings | None, eval_source: PipelineSource | None) -> None:
    """Raise ``ValueError`` for a pass count below 1 or an evaluation without held-out data."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be an integer >= 1, got {passes!r}")
    if evaluation is not None and eval_source is None:
        raise ValueError("evaluation while training needs eval_source (the held-out examples)")


class Evaluations:
    """Evaluations of ``pipe``'s model on ``source`` under ``settings``; with early stopping, the
    best model is kept (``best_model``: ``(keys, rows, dense)``), and with a checkpoint directory
    also written under it as an export (:data:`BEST`) so that a crash does not lose it."""

    def __init__(self, settings: EvalSettings, source: PipelineSource) -> None:
        self.track = EvalTrack(settings)
        self.source = source
        self.best_model: tuple[Any, Any, dict] | None = None
        self.seconds = 0.0
        self.reader: Any = None  # its own reader actor on node 0: the training reader reads on
        self._node_id: str | None = None
        self.board: TensorBoardLog | None = None  # each evaluation's figures as scalars

    def latest(self) -> EvalPoint | None:
        """The newest evaluation (``None`` before the first)."""
        return self.track.points[-1] if self.track.points else None

    def _reader(self, pipe: Evaluated, nodes: list[NodeActors]) -> Any:
        """This evaluation's reader, opened on the held-out source (started on first use, and again
        after a recovery replaced node 0)."""
        node = nodes[0]
        if self.reader is None or self._node_id != node.node_id:
            self.reader = start_reader(pipe, node, self.source, 0, 1, len(nodes), role="EvalReader")
            self._node_id = node.node_id
        else:
            self.reader.open.remote(self.source, pipe.batch_size, 0, 1)
        return self.reader

    def close(self) -> None:
        """Stop the reader actor."""
        if self.reader is not None:
            ray.kill(self.reader)
            self.reader = None

    @property
    def keeps_best(self) -> bool:
        return self.track.settings.patience is not None

    def due(self, batches_in_pass: int) -> bool:
        return self.track.due(batches_in_pass)

    def evaluate(self, pipe: Evaluated, nodes: list[NodeActors], batches: int, pass_index: int) -> EvalPoint:
        """Score ``pipe``'s model (stage actors ``nodes``) after ``batches`` batches, its rows
        written back and flushed already; record it and keep it when it is the best (a second call
        at the same ``batches``, a pass end that was due anyway, scores nothing)."""
        last = self.track.points[-1] if self.track.points else None
        if last is not None and last.batches == batches:
            return last
        t0 = time.perf_counter()
        got = score(nodes, self._reader(pipe, nodes))
        point = EvalPoint(batches, pass_index, got["auc"], got["logloss"], got["examples"], time.perf_counter() - t0)
        if self.track.record(point) and self.keeps_best:
            self._keep(pipe)
        if self.board is not None:
            self.board.add(batches, {"eval/auc": point.auc, "eval/logloss": point.logloss})
        self.seconds += time.perf_counter() - t0
        return point

    def _keep(self, pipe: Evaluated) -> None:
        keys, rows = pipe.export_rows()
        self.best_model = (keys, rows, pipe.dense_state())
        directory = pipe.checkpoint_settings.directory if pipe.checkpoint_settings is not None else None
        if directory is None or "://" in str(directory):
            return
        from hpsray.export import export, schema_of_source

        best = self.track.best.as_dict() if self.track.best is not None else None
        source, extra = pipe.source, {"trainer": "hpsray", "best": best}
        with replacing(os.path.join(directory, BEST), os.path.join(directory, f".{BEST}.tmp")) as staging:
            shutil.rmtree(staging, ignore_errors=True)  # a crash's leftover
            export(
                self.best_model,
                str(staging),
                pipe.config,
                n_slots=source.n_slots,
                n_dense=source.n_dense,
                schema=schema_of_source(source),
                extra=extra,
            )


def score(nodes: list[NodeActors], reader: Any) -> dict:
    """AUC and log-loss over what ``reader`` (an opened reader actor) reads, each key's row looked
    up at its owner among ``nodes`` and the model run by node 0's trainer."""
    labels, probs = [], []
    while True:
        read = ray.get(reader.read.remote(None))  # no batch id: not a training batch
        if read.examples == 0:
            break
        rows = [node.mem.lookup.remote(k) for node, k in zip(nodes, read.keys_by_owner)]
        probs.append(ray.get(nodes[0].trainer.predict.remote(read.batch, read.keys_by_owner, rows)))
        labels.append(ray.get(read.batch).labels)
    if not labels:
        raise ValueError("the evaluation source produced no examples")
    y, p = np.concatenate(labels), np.concatenate(probs)
    return {"auc": auc(y, p), "logloss": logloss(y, p), "examples": int(y.size)}


def catch_interrupt(interrupt: Callable[[], None]) -> Any:
    """In the main thread, make the first Ctrl-C call ``interrupt`` (the pipeline's: stop at the
    next batch boundary) and a second one interrupt at once; returns the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def ask_to_stop(signum, frame):
        interrupt()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    return signal.signal(signal.SIGINT, ask_to_stop)
