"""A serving replica's Prometheus metrics: what ``GET /metrics`` answers.

Counted in the replica (no Ray, no prometheus_client): HTTP ``/predict`` requests by status code,
examples predicted, request latency as a histogram, model swaps; and as gauges the served
model's rows and delta and its lookup's figures (``ServableModel.stats()``: memory rows, hit
counts ...). Each scrape is answered by one replica (Serve balances it like any request): every
series carries a ``replica`` label (its pid), so scrapes of several replicas stay apart; Ray's own
metrics port has the Serve-level figures of all of them (docs/serving.md: Metrics).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS_S", "ServeMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
PREFIX = "hpsray_serve_"
_NAME = re.compile(r"[^a-zA-Z0-9_]")


class ServeMetrics:
    """The counters of one replica; :meth:`observe` after each ``/predict``, :meth:`exposition`
    for a scrape."""

    def __init__(self) -> None:
        self.requests: dict[int, int] = {}
        self.examples = 0
        self.buckets = [0] * len(LATENCY_BUCKETS_S)  # not cumulative here; exposition sums them
        self.latency_sum = 0.0
        self.latency_count = 0

    def observe(self, status: int, examples: int, seconds: float) -> None:
        """One ``/predict`` request answered with ``status``, ``examples`` predicted, in ``seconds``."""
        self.requests[status] = self.requests.get(status, 0) + 1
        self.examples += examples
        i = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        if i < len(self.buckets):
            self.buckets[i] += 1
        self.latency_sum += seconds
        self.latency_count += 1

    def exposition(self, gauges: Mapping[str, object], swaps: int, replica: str) -> str:
        """The Prometheus text format of the counters, ``swaps`` and the numeric ``gauges``
        (a dict's nested numbers flattened, names made valid; others left out)."""
        lab = f'replica="{replica}"'
        lines = [
            f"# HELP {PREFIX}requests_total HTTP /predict requests answered, by status code",
            f"# TYPE {PREFIX}requests_total counter",
        ]
        lines += [f'{PREFIX}requests_total{{{lab},code="{c}"}} {n}' for c, n in sorted(self.requests.items())]
        lines += [
            f"# HELP {PREFIX}examples_total examples predicted over HTTP",
            f"# TYPE {PREFIX}examples_total counter",
            f"{PREFIX}examples_total{{{lab}}} {self.examples}",
            f"# HELP {PREFIX}request_seconds time from a /predict request to its answer",
            f"# TYPE {PREFIX}request_seconds histogram",
        ]
        running = 0
        for bound, n in zip(LATENCY_BUCKETS_S, self.buckets):
            running += n
            lines.append(f'{PREFIX}request_seconds_bucket{{{lab},le="{bound:g}"}} {running}')
        lines += [
            f'{PREFIX}request_seconds_bucket{{{lab},le="+Inf"}} {self.latency_count}',
            f"{PREFIX}request_seconds_sum{{{lab}}} {self.latency_sum:.6f}",
            f"{PREFIX}request_seconds_count{{{lab}}} {self.latency_count}",
            f"# HELP {PREFIX}swaps_total newer exports swapped in",
            f"# TYPE {PREFIX}swaps_total counter",
            f"{PREFIX}swaps_total{{{lab}}} {swaps}",
        ]
        for name, value in sorted(_numbers(gauges).items()):
            metric = PREFIX + "model_" + name
            lines += [f"# TYPE {metric} gauge", f"{metric}{{{lab}}} {value:g}"]
        return "\n".join(lines) + "\n"


def _numbers(d: Mapping[str, object], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in d.items():
        name = _NAME.sub("_", f"{prefix}{key}")
        if isinstance(value, Mapping):
            out.update(_numbers(value, name + "_"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out
