"""Live metrics of a running pipeline on the node's Prometheus endpoint (issue 18).

A background thread scrapes ``http://NODE:MetricsExportPort/metrics`` every second while a short
``fit()`` runs, and the test finds every hpsray metric (:data:`METRICS`: the gauges and the three
StageClock metrics) with plausible values, and every series the Grafana dashboard
(docs/grafana/hpsray.json) queries. Ray names them ``ray_<name>`` (and counters
``ray_<name>_total``): a search for the bare ``hpsray_batches`` name with a tag brace after it
never matches. Only the series of this test's own processes count (Ray's ``WorkerId`` label): the
agent goes on exporting a killed worker's last values for tens of seconds, so an earlier test's
trainer of two devices would show bytes exchanged on "node 0".
"""

import pathlib
import re
import threading
import time
import urllib.request

import pytest

from hpsray.actors.livemetrics import METRICS, LiveGauges, prometheus_names
from hpsray.data import PlantedCTR
from hpsray.pipelines import SyntheticSource

from small_pipeline import CFG, small_pipeline  # tests/small_pipeline.py

LINE = re.compile(r"^(ray_hpsray_\w+)\{([^}]*)\} (\S+)$")
DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana" / "hpsray.json"
PROBE_NODE = "9"  # the node tag of the probe actor below; the pipeline's nodes are 0..n-1
# set by the trainer through LiveGauges.set_sync after every batch (zero on one node under BSP);
# a probe actor also sets them to values a one-node run cannot produce
TRAINER_SYNC = {"ray_hpsray_max_staleness", "ray_hpsray_exchanged_bytes_per_minibatch"}


def _scrape(url: str, seen: dict, stop: threading.Event) -> None:
    """Every hpsray series of the endpoint into ``seen[(name, stage or edge, node, WorkerId)]``."""
    while not stop.is_set():
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            text = ""
        for line in text.splitlines():
            m = LINE.match(line)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
                stage = labels.get("stage", labels.get("edge", ""))
                key = (m.group(1), stage, labels.get("node", ""), labels.get("WorkerId", ""))
                seen[key] = float(m.group(3))
        stop.wait(1.0)


@pytest.mark.slow
def test_gauges_reach_the_prometheus_endpoint_during_a_run(ray_local):
    ray = ray_local
    node = ray.nodes()[0]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    scraped: dict = {}
    stop = threading.Event()
    scraper = threading.Thread(target=_scrape, args=(url, scraped, stop), daemon=True)
    scraper.start()

    class SyncProbe:  # defined here: Ray ships it by value (workers cannot import this test module)
        """Sets the trainer's synchronisation gauges as a trainer of two batches would."""

        def run(self) -> None:
            gauges = LiveGauges(stage="train", node=PROBE_NODE)
            exchanged = [100, 200]
            gauges.set_sync(1, exchanged)
            exchanged += [500, 700]  # the second batch's two mini-batches: mean 600
            gauges.set_sync(3, exchanged)

    probe = ray.remote(num_cpus=0)(SyncProbe).remote()
    ray.get(probe.run.remote())
    own = {ray.get_runtime_context().get_worker_id(), _worker_id(ray, probe)}  # the driver sets the edges'

    def series() -> dict:
        """``{(name, stage, node): value}`` of this test's processes."""
        return {(name, stage, n): v for (name, stage, n, w), v in list(scraped.items()) if w in own}

    data = PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=2, seed=0)
    config = CFG
    every = {s for name, kind in METRICS.items() for s in prometheus_names(name, kind)}
    want = every
    queried = set(re.findall(r"\bray_hpsray_\w+", DASHBOARD.read_text()))

    def names(from_run: bool = True) -> set:
        return {name for name, _, n in series() if (n != PROBE_NODE) == from_run}

    def problems() -> list:
        last = {name: v for (name, _, n), v in series().items() if n != PROBE_NODE}
        out = [f"missing {sorted(want - names())}"] if not want <= names() else []
        out += [f"probe missing {sorted(TRAINER_SYNC - names(False))}"] if not TRAINER_SYNC <= names(False) else []
        checks = {
            "ray_hpsray_memps_hit_rate": lambda v: 0.0 <= v <= 1.0,
            "ray_hpsray_memps_occupancy": lambda v: 0.0 < v <= 1.0,
            "ray_hpsray_ssd_bytes_written": lambda v: v > 0,
            "ray_hpsray_ssd_live_bytes": lambda v: v > 0,
            "ray_hpsray_examples_per_s": lambda v: v > 0,
            "ray_hpsray_loss": lambda v: 0.0 < v < 5.0,
        }
        out += [f"{name} = {last.get(name)}" for name, ok in checks.items() if not ok(last.get(name, float("nan")))]
        return out

    with small_pipeline(SyntheticSource(data, rows=16_000), config, mem_rows=4000, batch_size=2000) as pipe:
        report = pipe.fit(progress=False)
        own |= {_worker_id(ray, actor) for actor in pipe.actors().values()}
        deadline = time.time() + 60  # Ray exports every few seconds: wait for the last values
        while time.time() < deadline and problems():
            time.sleep(1)
    stop.set()
    ray.kill(probe)
    assert not problems(), (problems(), report.get("ssd"), report.get("cache"))
    assert queried <= names() | names(False), f"the dashboard queries series never exported: {queried - names()}"
    seen = series()
    value = {name: v for (name, _, n), v in seen.items() if n != PROBE_NODE}
    assert seen[("ray_hpsray_batches_total", "train", "0")] >= 1
    # edges carry the node like the stages: {edge: "read->pull", node: "0"}
    edges = {(stage, n) for name, stage, n in seen if name == "ray_hpsray_queue_depth"}
    assert edges >= {("read->pull", "0"), ("train->write-back", "0")}, edges
    # one node, BSP: nothing stale, nothing exchanged
    for name in TRAINER_SYNC:
        assert value[name] == 0.0, (name, value[name])
    assert seen[("ray_hpsray_max_staleness", "train", PROBE_NODE)] == 3.0
    assert seen[("ray_hpsray_exchanged_bytes_per_minibatch", "train", PROBE_NODE)] == 600.0


def _worker_id(ray, actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_worker_id()))


def test_a_gauge_that_cannot_register_is_logged(ray_local, caplog):
    gauges = LiveGauges(stage="x", node=0)
    with caplog.at_level("WARNING", logger="hpsray.metrics"):
        gauges.set(no_such_gauge=1.0)  # not in GAUGES: registering it fails
    assert "cannot register metric hpsray_no_such_gauge" in caplog.text and "KeyError" in caplog.text


def test_edge_names_carry_their_node_as_a_tag():
    assert LiveGauges(edge="read→pull[node 3]").tags == {"edge": "read->pull", "node": "3"}
    assert LiveGauges(edge="train→write-back").tags == {"edge": "train->write-back", "node": "0"}
    assert LiveGauges(stage="pull", node=2).tags == {"stage": "pull", "node": "2"}


def test_set_sync_averages_the_new_entries_of_the_running_list(monkeypatch):
    gauges = LiveGauges(stage="train", node=0)
    got: list = []
    monkeypatch.setattr(gauges, "set", lambda **v: got.append(v))
    exchanged: list = []
    gauges.set_sync(0, exchanged)  # one node: nothing exchanged
    exchanged += [10, 30]
    gauges.set_sync(2, exchanged)
    gauges.set_sync(2, 123.0)  # or the figure itself
    assert got == [
        {"max_staleness": 0, "exchanged_bytes_per_minibatch": 0.0},
        {"max_staleness": 2, "exchanged_bytes_per_minibatch": 20.0},
        {"max_staleness": 2, "exchanged_bytes_per_minibatch": 123.0},
    ]
