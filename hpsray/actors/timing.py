"""Per-stage timing inside actors: busy seconds per batch, and Ray metrics tagged by stage and node."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager


class StageClock:
    """Busy time of one stage of one node, per batch and in total.

    Also exports ``ray.util.metrics`` (docs/architecture.md: Observability) when running inside Ray:
    a counter of batches,
    a histogram of seconds per batch, and a counter of busy seconds, tagged ``{stage, node}``.
    """

    def __init__(self, stage: str, node: int) -> None:
        self.stage, self.node = stage, node
        self.busy_s = 0.0
        self.per_batch: dict = {}
        self.cpu_per_batch: dict = {}  # CPU seconds of this process (every thread) while busy
        self.events: list[tuple[float, float, object]] = []  # (start, end, batch) wall-clock
        self._metrics = None
        try:
            import ray
            from ray.util import metrics

            if ray.is_initialized():
                tags = {"stage": stage, "node": str(node)}
                keys = ("stage", "node")
                self._metrics = (
                    metrics.Counter("hpsray_batches", "batches handled per stage", tag_keys=keys),
                    metrics.Histogram(
                        "hpsray_batch_seconds",
                        "seconds per batch per stage",
                        boundaries=[0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60],
                        tag_keys=keys,
                    ),
                    metrics.Counter("hpsray_busy_seconds", "busy seconds per stage", tag_keys=keys),
                )
                for m in self._metrics:
                    m.set_default_tags(tags)
        except Exception:  # the clock itself always works; the failure is logged, never swallowed
            logging.getLogger("hpsray.metrics").warning(
                "cannot register the metrics of stage %s node %s", stage, node, exc_info=True
            )
            self._metrics = None

    @contextmanager
    def timed(self, batch=None):
        t0 = time.time()
        p0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            dt = time.perf_counter() - p0
            self.busy_s += dt
            if batch is not None:
                self.per_batch[batch] = self.per_batch.get(batch, 0.0) + dt
                self.cpu_per_batch[batch] = self.cpu_per_batch.get(batch, 0.0) + time.process_time() - c0
            self.events.append((t0, t0 + dt, batch))
            if self._metrics is not None:
                self._metrics[0].inc()
                self._metrics[1].observe(dt)
                self._metrics[2].inc(dt)

    def snapshot(self) -> dict:
        """The clock's figures: ``per_batch`` busy seconds, ``cpu_per_batch`` the CPU seconds its
        process (every thread of it: torch's, numba's, I/O threads) used while busy with each
        batch, and ``process_cpu_s``: CPU seconds of this actor's process so far, for a caller
        to difference over a run."""
        return {
            "process_cpu_s": time.process_time(),
            "stage": self.stage,
            "node": self.node,
            "busy_s": self.busy_s,
            "per_batch": dict(self.per_batch),
            "cpu_per_batch": dict(self.cpu_per_batch),
            "events": list(self.events),
        }
