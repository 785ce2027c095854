"""Live gauges of a running pipeline through ``ray.util.metrics`` (issue 18): they reach the node's
Prometheus endpoint (``ray.nodes()[i]["MetricsExportPort"]``, names prefixed ``ray_``) and the
Ray dashboard's Grafana, while the run report only exists at the end.

Each stage actor (and the driver, for its edges) owns one :class:`LiveGauges` with its tags; a
gauge is created on its first :meth:`~LiveGauges.set`. A failure to create or set one is logged
(``hpsray.metrics``, with the traceback), never swallowed, and never stops training.

:data:`METRICS` names every metric hpsray registers (these gauges and the counters and histogram
of :class:`~hpsray.actors.timing.StageClock`) with its kind; the Grafana dashboard
``docs/grafana/hpsray.json`` queries exactly these (``tests/plan/test_grafana_dashboard.py``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.util.metrics import Gauge

__all__ = ["GAUGES", "METRICS", "LiveGauges", "prometheus_names"]

log = logging.getLogger("hpsray.metrics")

# name (without the "hpsray_" prefix) -> description
GAUGES = {
    "queue_depth": "object refs in flight on a pipeline edge (driver side), tagged {edge, node}",
    "memps_hit_rate": "MEM-PS hit rate of the last pull (distinct keys)",
    "memps_occupancy": "MEM-PS resident rows / capacity",
    "memps_pinned_rows": "MEM-PS rows pinned by in-flight batches",
    "ssd_bytes_read": "SSD-PS bytes read since the store opened",
    "ssd_bytes_written": "SSD-PS bytes written since the store opened",
    "ssd_live_bytes": "SSD-PS bytes of live rows",
    "ssd_disk_bytes": "SSD-PS bytes of parameter files on disk",
    "ssd_compactions": "SSD-PS compaction passes since the store opened",
    "examples_per_s": "examples per second of the trainer's last batch (busy time)",
    "loss": "mean training log-loss of the trainer's last batch",
    "max_staleness": "largest clock gap seen between this trainer and the slowest (0 under BSP; SSP/ASP)",
    "exchanged_bytes_per_minibatch": "bytes this trainer sent to the others per global mini-batch, "
    "mean over its last batch (0 on one node)",
    # the driver's (stage "driver"), the figures of its progress lines (hpsray/pipelines/progress.py)
    "progress_examples": "examples trained in the pass so far",
    "progress_examples_per_s": "examples per second over the last progress interval",
    "progress_eta_s": "seconds left in the pass at that rate (-1: the input's size is unknown)",
    "progress_checkpoint_batch": "batches trained at the newest checkpoint (-1: none yet)",
}

# every metric hpsray registers, full name -> kind ("gauge", "counter", "histogram");
# the StageClock's three are registered in hpsray/actors/timing.py
METRICS = {
    **{f"hpsray_{name}": "gauge" for name in GAUGES},
    "hpsray_batches": "counter",
    "hpsray_batch_seconds": "histogram",
    "hpsray_busy_seconds": "counter",
}


def prometheus_names(name: str, kind: str) -> set[str]:
    """The series names Ray's Prometheus endpoint shows for a metric: ``ray_`` before the name,
    ``_total`` after a counter's, ``_bucket``/``_sum``/``_count`` after a histogram's."""
    base = f"ray_{name}"
    if kind == "counter":
        return {f"{base}_total"}
    if kind == "histogram":
        return {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return {base}


def _ascii(value: object) -> str:
    """Ray records tag values as ASCII (``UnicodeEncodeError`` otherwise): ``read→pull`` → ``read->pull``."""
    return str(value).replace("→", "->").encode("ascii", "replace").decode()


_EDGE_NODE = re.compile(r"^(.*)\[node (\d+)\]$")


def _edge_tags(tags: dict) -> dict:
    """An edge named ``read→pull[node 2]`` is tagged ``{edge: "read->pull", node: "2"}`` (one
    node: ``read→pull``, node ``0``), so its panels group by node like the stages'."""
    if "edge" not in tags or "node" in tags:
        return tags
    m = _EDGE_NODE.match(str(tags["edge"]))
    edge, node = (m.group(1), m.group(2)) if m else (tags["edge"], "0")
    return {**tags, "edge": edge, "node": node}


class LiveGauges:
    """The gauges of one stage of one node (``tags``: e.g. ``{"stage": "pull", "node": "0"}``).

    Outside Ray (``ray.is_initialized()`` false) every call is a no-op.
    """

    def __init__(self, **tags: object) -> None:
        self.tags = {k: _ascii(v) for k, v in _edge_tags(tags).items()}
        self._gauges: dict[str, Gauge] = {}
        self._failed: set[str] = set()
        self._exchanged_seen = 0
        self.enabled = False
        try:
            import ray

            self.enabled = ray.is_initialized()
        except ImportError:
            log.warning("ray is not importable: no live metrics for %s", self.tags)

    def _gauge(self, name: str) -> Gauge | None:
        g = self._gauges.get(name)
        if g is None and name not in self._failed:
            try:
                from ray.util.metrics import Gauge

                g = Gauge(f"hpsray_{name}", GAUGES[name], tag_keys=tuple(self.tags))
                g.set_default_tags(self.tags)
                self._gauges[name] = g
            except Exception:  # noqa: BLE001 - logged with its traceback, training goes on
                self._failed.add(name)
                log.warning("cannot register metric hpsray_%s %s", name, self.tags, exc_info=True)
        return g

    def set(self, **values: float) -> None:
        """Set gauges by short name (keys of :data:`GAUGES`)."""
        if not self.enabled:
            return
        for name, value in values.items():
            g = self._gauge(name)
            if g is None:
                continue
            try:
                g.set(float(value))
            except Exception:  # noqa: BLE001
                self._failed.add(name)
                self._gauges.pop(name, None)
                log.warning("cannot set metric hpsray_%s %s", name, self.tags, exc_info=True)

    def set_sync(self, max_staleness: float, exchanged_bytes: float | Sequence[float]) -> None:
        """The trainer's synchronisation gauges, once per batch: ``max_staleness`` (SSP/ASP; 0
        under BSP) and the bytes exchanged per global mini-batch, either as one number or as the
        trainer's running list of bytes per mini-batch, of which the entries added since the last
        call are averaged (none: 0, as on one node)."""
        if isinstance(exchanged_bytes, Sequence):
            new = exchanged_bytes[self._exchanged_seen :]
            self._exchanged_seen = len(exchanged_bytes)
            per_minibatch = float(sum(new)) / len(new) if len(new) else 0.0
        else:
            per_minibatch = float(exchanged_bytes)
        self.set(max_staleness=max_staleness, exchanged_bytes_per_minibatch=per_minibatch)
