"""Live gauges of a running pipeline through ``ray.util.metrics`` (issue 18): they reach the node's
Prometheus endpoint (``ray.nodes()[i]["MetricsExportPort"]``, names prefixed ``ray_``) and the
Ray dashboard's Grafana, while the run report only exists at the end.

Each stage actor (and the driver, for its edges) owns one :class:`LiveGauges` with its tags; a
gauge is created on its first :meth:`~LiveGauges.set`. A failure to create or set one is logged
(``hpsray.metrics``, with the traceback), never swallowed, and never stops training.
"""

from __future__ import annotations

import logging

__all__ = ["GAUGES", "LiveGauges"]

log = logging.getLogger("hpsray.metrics")

# name (without the "hpsray_" prefix) -> description
GAUGES = {
    "queue_depth": "object refs in flight on a pipeline edge (driver side)",
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
}


def _ascii(value: object) -> str:
    """Ray records tag values as ASCII (``UnicodeEncodeError`` otherwise): ``read→pull`` → ``read->pull``."""
    return str(value).replace("→", "->").encode("ascii", "replace").decode()


class LiveGauges:
    """The gauges of one stage of one node (``tags``: e.g. ``{"stage": "pull", "node": "0"}``).

    Outside Ray (``ray.is_initialized()`` false) every call is a no-op.
    """

    def __init__(self, **tags: str) -> None:
        self.tags = {k: _ascii(v) for k, v in tags.items()}
        self._gauges: dict = {}
        self._failed: set[str] = set()
        self.enabled = False
        try:
            import ray

            self.enabled = ray.is_initialized()
        except ImportError:
            log.warning("ray is not importable: no live metrics for %s", self.tags)

    def _gauge(self, name: str):
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
