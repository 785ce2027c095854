"""The run report's schema: :class:`RunReport` serialises to exactly today's JSON keys
(``tests/report_keys.py``; ``tests/pipelines/test_pipeline_system.py`` checks a real ``fit()``)."""

from __future__ import annotations

import json

import pytest

from hpsray.pipelines.summary import busy_within
from hpsray.report import (
    Demo,
    EdgeFill,
    Evaluation,
    NodeFigures,
    Overlap,
    ResumedFrom,
    RunReport,
    SsdTotals,
    Start,
    Sync,
    TableFigures,
    json_keys,
)

from report_keys import (  # tests/report_keys.py
    CHECKPOINTED,
    COMMANDS,
    DEMO_KEYS,
    EDGE_KEYS,
    EVALUATING,
    FIT_KEYS,
    OVERLAP_KEYS,
    PER_NODE_KEYS,
    REFERENCE_KEYS,
    SEVERAL_NODES,
    SEVERAL_TABLES,
    SSD_KEYS,
    START_KEYS,
    SYNC_KEYS,
    TABLE_KEYS,
)


def full_report() -> RunReport:
    busy = {"read": 1.0, "pull": 0.5, "load": 2.0, "train": 3.0}
    return RunReport(
        mode="ssp",
        nodes=2,
        devices_per_node=1,
        batches=2,
        examples=200,
        wall_s=4.0,
        stage_busy_s=busy,
        stage_cpu_s={k: v / 2 for k, v in busy.items()},
        per_batch_s={k: {"0": v / 2, "1": v / 2} for k, v in busy.items()},
        cache_hit_rate={"0": 0.0, "1": 0.5},
        ssd=SsdTotals(
            bytes_read=10,
            bytes_written=20,
            files=1,
            disk_bytes=30,
            live_bytes=15,
            compactions=0,
            load_seconds=0.1,
            dump_seconds=0.2,
        ),
        cache={"hits": 1, "misses": 1, "hit_rate": 0.5},
        loss={"0": 0.7, "1": 0.6},
        queues={"read→pull": EdgeFill(capacity=2, max_depth=2, stalls=1)},
        overlap=Overlap(batches=0, load_during_train=0.0, read_load_train=0.0),
        working_set={},
        bad_input={"node 0": {}, "node 1": {}},
        time_to_first_batch_s=1.5,
        sync=Sync(
            consistency="ssp",
            staleness_bound=2,
            propagation=None,
            max_staleness_observed=1,
            max_staleness_across_batches=0,
            max_owner_staleness=0,
            dense="allreduce",
            exchanged_bytes_per_minibatch=8.0,
        ),
        per_node=[NodeFigures(node=i, stage_busy_s=busy, examples=100, cache={}) for i in range(2)],
        tables={"ids": TableFigures(16, 10, 4, 0.4, 5, 80, 1, 16)},
        startup_s=0.5,
        start=Start(ray_init_s=0.5, actors_s=0.5, other_s=0.5, ready_s={"read": 0.1}),
        checkpoints={"count": 1},
        recovery=[],
        reshaped={"from_nodes": 1, "to_nodes": 2, "seconds": 0.1},
        evaluations={"points": [], "best": None, "stopped_early": False, "metric": "auc", "seconds": 0.0},
        trainer="hpsray",
        evaluation=Evaluation(auc=None, logloss=None, eval_examples=0),
        export={"rows": 3},
        rows=3,
        bad_rows=0,
        config={},
        config_file="job.toml",
        resumed_from=ResumedFrom(checkpoint="ckpt", batch=1),
        compare={"equal": True},
        demo=Demo(distinct_keys=3, mem_rows=2, rows_evicted=1, rows_loaded_from_ssd=1),
    )


def test_every_section_serialises_to_todays_keys():
    data = full_report().as_dict()
    every = FIT_KEYS | SEVERAL_NODES | SEVERAL_TABLES | CHECKPOINTED | EVALUATING | COMMANDS
    assert set(data) == every == json_keys(), set(data) ^ every
    assert set(data["ssd"]) == SSD_KEYS and data["ssd"]["space_ratio"] == 2.0
    assert set(data["queues"]["read→pull"]) == EDGE_KEYS
    assert set(data["overlap"]) == OVERLAP_KEYS
    assert set(data["start"]) == START_KEYS
    assert set(data["sync"]) == SYNC_KEYS and data["sync"]["propagation"] is None
    assert [set(n) for n in data["per_node"]] == [PER_NODE_KEYS] * 2
    assert set(data["tables"]["ids"]) == TABLE_KEYS
    assert data["resumed_from"] == {"checkpoint": "ckpt", "batch": 1}
    assert set(data["demo"]) == DEMO_KEYS
    assert data["auc"] is None and data["logloss"] is None and data["eval_examples"] == 0
    assert json.loads(json.dumps(data)) == data


def test_derived_figures_and_absent_sections():
    report = RunReport(
        trainer="reference",
        mode="reference",
        nodes=1,
        batches=2,
        examples=100,
        wall_s=4.0,
        stage_busy_s={"read": 1.0, "train": 2.0},
        per_batch_s={"read": {"0": 0.5}, "train": {"0": 1.0}},
        cache_hit_rate={},
        loss={"0": 0.7},
        bad_input={},
    )
    report.evaluation = Evaluation(auc=0.75, logloss=0.5, eval_examples=10)
    report.rows = 7
    data = report.as_dict()
    assert set(data) == REFERENCE_KEYS, set(data) ^ REFERENCE_KEYS
    assert data["ssd"] == {}  # no SSD-PS: an empty section, as the stage table expects
    assert data["examples_per_s"] == pytest.approx(25.0)
    assert data["pipeline_efficiency"] == pytest.approx(0.5)
    assert data["auc"] == 0.75 and data["eval_examples"] == 10


def test_no_wall_time_gives_zero_rates():
    report = RunReport(
        mode="bsp",
        nodes=1,
        batches=0,
        examples=0,
        wall_s=0.0,
        stage_busy_s={},
        per_batch_s={},
        cache_hit_rate={},
        loss={},
        bad_input={},
    )
    assert report.examples_per_s == 0.0 and report.pipeline_efficiency == 0.0


def test_efficiency_counts_only_the_busy_seconds_inside_the_timed_wall():
    """The fill a pass submits while its trainers start runs before the clock: the figures of a
    CI run where it did (the read of batch 0, 0.082 s, before a 0.170 s wall) gave an efficiency
    of 1.04. Counted inside the timed windows, the share is at most 1 and the busy seconds stay."""
    read = {"events": [(9.90, 9.982, 0), (10.00, 10.032, 1), (10.04, 10.074, 2), (10.08, 10.109, 3)]}
    train = {"events": [(10.0, 10.035, 0), (10.04, 10.067, 1), (10.07, 10.083, 2), (10.09, 10.102, 3)]}
    dump = {"events": [(10.01, 10.05, 1), (10.03, 10.06, 1), (10.165, 10.3, 3), (10.02, 10.1, 7)]}
    windows = [(10.0, 10.170)]
    mine = {0, 1, 2, 3}
    assert busy_within([read], mine, windows) == pytest.approx(0.032 + 0.034 + 0.029)
    assert busy_within([train], mine, windows) == pytest.approx(0.035 + 0.027 + 0.013 + 0.012)
    # overlapping calls (a write beside another) count once; batch 7 is not this run's; past the wall nothing
    assert busy_within([dump], mine, windows) == pytest.approx(0.05 + 0.005)
    assert busy_within([dump, train], mine, [(10.0, 10.02), (10.16, 10.2)]) == pytest.approx(0.02 + 0.035)
    busy = {"read": 0.1764, "train": 0.0862}
    kwargs = dict(mode="bsp", nodes=1, batches=4, examples=4000, wall_s=0.170, stage_busy_s=busy)
    rest = dict(per_batch_s={}, cache_hit_rate={}, loss={}, bad_input={})
    every_second = RunReport(**kwargs, **rest)  # type: ignore[arg-type]
    assert every_second.pipeline_efficiency > 1  # the fault: the fill's seconds against a wall without them
    within = {"read": busy_within([read], mine, windows), "train": busy_within([train], mine, windows)}
    report = RunReport(**kwargs, **rest, busy_in_wall=within)  # type: ignore[arg-type]
    assert report.pipeline_efficiency == pytest.approx(max(within.values()) / 0.170) and report.pipeline_efficiency <= 1
    assert report.as_dict()["stage_busy_s"] == busy and "busy_in_wall" not in report.as_dict()
