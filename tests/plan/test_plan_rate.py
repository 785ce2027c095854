"""The planner's rate (issue 31): stages that share a node's cores are not free, the bottleneck is
named, and MEM-PS's hit rate comes from MEM-PS itself at the job's budget."""

import dataclasses

import pytest

from hpsray.job import JobConfig
from hpsray.plan import make_plan
from hpsray.plan.calibrate import STAGES, Calibration, bottleneck, predict_rate
from hpsray.plan.render import render

ONE_SECOND_EACH = Calibration(
    read_s_per_example=1e-3,  # 1,000 examples: 1 s
    train_s_per_example=1e-3,
    pull_s_per_row=1e-3,  # 1,000 rows: 1 s
    ssd_load_s_per_row=5e-4,
    ssd_dump_s_per_row=5e-4,
    dense_params=0,
    cores=4,
    seconds=0.0,
    cpu_per_wall=dict.fromkeys(STAGES, 1.0),
    row_width=4,
)


def test_stages_sharing_the_cores_are_not_free():
    rate, stages = predict_rate(ONE_SECOND_EACH, 1000, 1000, 1000)
    assert stages == pytest.approx(dict.fromkeys(STAGES, 1.0))
    assert rate == pytest.approx(1000.0)  # four one-second stages on four cores: one batch a second
    two = dataclasses.replace(ONE_SECOND_EACH, cores=2)
    assert predict_rate(two, 1000, 1000, 1000)[0] == pytest.approx(500.0)
    assert bottleneck(two, stages) == "cores"
    threaded = dataclasses.replace(ONE_SECOND_EACH, cpu_per_wall={**dict.fromkeys(STAGES, 1.0), "train": 4.0})
    assert predict_rate(threaded, 1000, 1000, 1000)[0] == pytest.approx(1000.0 / (7.0 / 4.0))  # train uses 4 cores


def test_the_slowest_stage_is_the_bottleneck_when_cores_are_left():
    rate, stages = predict_rate(ONE_SECOND_EACH, 3000, 1000, 1000)  # read and train: 3 s each
    assert rate == pytest.approx(1000.0)
    assert bottleneck(ONE_SECOND_EACH, stages) in ("read", "train")
    _, idle = predict_rate(ONE_SECOND_EACH, 1000, 1000, 0)
    assert idle["load"] == 0.0


def test_a_calibrated_plan_names_its_bottleneck_and_memps_hit_rate(tmp_path):
    job = JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 12_000, "slots": 6, "keys": 3000, "dense": 2, "seed": 5}},
            "model": {"dim": 4, "hidden": [8]},
            "tiers": {"mem_rows": 9000},
            "pipeline": {"batch_size": 2000, "minibatch_size": 500},
        },
        where="job.toml",
        base_dir=str(tmp_path),
    )
    plan = make_plan(job, 12_000)
    cal = plan.calibration
    assert cal is not None and plan.predicted_examples_per_s and plan.predicted_examples_per_s > 0
    assert plan.bottleneck in (*STAGES, "cores")
    assert 0.0 < cal.memps_hit_rate < 1.0  # Zipf keys: the budget holds many, not all
    assert plan.per_node["ssd_ps"]["rows_per_batch"] == pytest.approx(
        plan.keys.batch_distinct_mean * (1 - cal.memps_hit_rate)
    )
    assert plan.to_dict()["bottleneck"] == plan.bottleneck
    assert "bottleneck: " in render(plan)
