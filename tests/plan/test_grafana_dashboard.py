"""The shipped Grafana dashboard (docs/grafana/hpsray.json) queries exactly the metrics hpsray
registers, under the names Ray's Prometheus endpoint gives them (issue 18).

What "registers" means is taken from the code itself: ``ray.util.metrics`` is replaced by
recorders, a :class:`StageClock` and a :class:`LiveGauges` (every gauge set) are made, and the
names and kinds they create are compared with :data:`METRICS` and with the dashboard's queries.
No Ray is started.
"""

import json
import pathlib
import re

import pytest

from hpsray.actors.livemetrics import GAUGES, METRICS, LiveGauges, prometheus_names
from hpsray.actors.timing import StageClock

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana" / "hpsray.json"
SERIES = re.compile(r"\bray_hpsray_\w+")


def _exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


@pytest.fixture
def registered(monkeypatch):
    """Full name -> kind of every metric the code creates, recorded instead of created."""
    import ray
    from ray.util import metrics

    seen: dict = {}

    def recorder(kind):
        class Metric:
            def __init__(self, name, description="", *args, tag_keys=(), **kwargs):
                assert description, name
                seen[name] = kind
                self.tag_keys = tuple(tag_keys)

            def set_default_tags(self, tags):
                assert set(tags) == set(self.tag_keys)

            def set(self, value=1.0, tags=None):
                pass

            inc = observe = set

        return Metric

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    for cls, kind in (("Gauge", "gauge"), ("Counter", "counter"), ("Histogram", "histogram")):
        monkeypatch.setattr(metrics, cls, recorder(kind))
    clock = StageClock("train", 0)
    with clock.timed(0):
        pass
    gauges = LiveGauges(stage="train", node=0)
    gauges.set(**dict.fromkeys(GAUGES, 1.0))
    gauges.set_sync(0, [])
    return seen


def test_metrics_lists_what_the_code_registers(registered):
    assert registered == METRICS


def test_every_query_names_a_registered_metric_and_every_metric_has_a_panel(registered):
    dash = json.loads(DASHBOARD.read_text())
    queried = {name for expr in _exprs(dash) for name in SERIES.findall(expr)}
    exported = {s: name for name, kind in registered.items() for s in prometheus_names(name, kind)}
    assert queried, "the dashboard queries no hpsray metric"
    assert queried <= set(exported), f"queries of metrics hpsray does not export: {sorted(queried - set(exported))}"
    assert {exported[s] for s in queried} == set(registered), "metrics without a panel"


def test_each_panel_splits_by_node_and_filters_by_the_dashboard_variables():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "SessionName", "node", "window"} <= variables
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert re.search(r"\bby \([^)]*\bnode\b", t["expr"]), (p["title"], t["expr"])
            assert 'SessionName=~"$SessionName"' in t["expr"] and 'node=~"$node"' in t["expr"], p["title"]
            assert "{{node}}" in t["legendFormat"], p["title"]
        refs = set(re.findall(r"\$(\w+)", json.dumps(p["targets"])))
        assert refs <= variables | {"__all"}, (p["title"], refs - variables)
