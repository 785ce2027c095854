"""Live metrics of a running pipeline on the node's Prometheus endpoint (issue 18).

A background thread scrapes ``http://NODE:MetricsExportPort/metrics`` every second while a short
``fit()`` runs, and the test finds every hpsray gauge and the three StageClock metrics with
plausible values. Ray names them ``ray_<name>`` (and counters ``ray_<name>_total``): a search for
the bare ``hpsray_batches`` name with a tag brace after it never matches.
"""

import re
import threading
import time
import urllib.request

import pytest

from hpsray.actors.livemetrics import GAUGES, LiveGauges
from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.pipelines import MemPSStage, Pipeline, SyntheticSource, TrainerStage

LINE = re.compile(r"^(ray_hpsray_\w+)\{([^}]*)\} (\S+)$")


def _scrape(url: str, seen: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            text = ""
        for line in text.splitlines():
            m = LINE.match(line)
            if m:
                labels = dict(kv.split("=", 1) for kv in re.findall(r'(\w+="[^"]*")', m.group(2)))
                key = (m.group(1), labels.get("stage", labels.get("edge", "")).strip('"'))
                seen[key] = float(m.group(3))
        stop.wait(1.0)


@pytest.mark.slow
def test_gauges_reach_the_prometheus_endpoint_during_a_run(ray_local):
    ray = ray_local
    node = ray.nodes()[0]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    seen: dict = {}
    stop = threading.Event()
    scraper = threading.Thread(target=_scrape, args=(url, seen, stop), daemon=True)
    scraper.start()
    data = PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=2, seed=0)
    config = TrainConfig(dim=4, hidden=(8,), minibatch_size=500)
    with Pipeline(
        SyntheticSource(data, rows=16_000), TrainerStage(config), MemPSStage(capacity_rows=4000), batch_size=2000
    ) as pipe:
        pipe.fit(progress=False)
        deadline = time.time() + 60  # Ray exports every few seconds: wait for the last values
        want = {f"ray_hpsray_{g}" for g in GAUGES} | {"ray_hpsray_batches_total", "ray_hpsray_busy_seconds_total"}
        while time.time() < deadline and not want <= {name for name, _ in seen}:
            time.sleep(1)
    stop.set()
    names = {name for name, _ in seen}
    assert want <= names, sorted(want - names)
    value = {name: v for (name, _), v in seen.items()}
    assert 0.0 <= value["ray_hpsray_memps_hit_rate"] <= 1.0
    assert 0.0 < value["ray_hpsray_memps_occupancy"] <= 1.0
    assert value["ray_hpsray_ssd_bytes_written"] > 0 and value["ray_hpsray_ssd_live_bytes"] > 0
    assert value["ray_hpsray_examples_per_s"] > 0 and 0.0 < value["ray_hpsray_loss"] < 5.0
    assert seen[("ray_hpsray_batches_total", "train")] >= 1
    assert {stage for name, stage in seen if name == "ray_hpsray_queue_depth"} >= {"read->pull", "train->write-back"}


def test_a_gauge_that_cannot_register_is_logged(ray_local, caplog):
    gauges = LiveGauges(stage="x", node=0)
    with caplog.at_level("WARNING", logger="hpsray.metrics"):
        gauges.set(no_such_gauge=1.0)  # not in GAUGES: registering it fails
    assert "cannot register metric hpsray_no_such_gauge" in caplog.text and "KeyError" in caplog.text
