"""The planner's rate (issue 31): stages that share a node's cores are not free, the bottleneck is
named, MEM-PS's hit rate comes from MEM-PS itself at the job's budget, and each stage pays what
its actor adds (a fixed cost per batch, the stretch of shared cores, the driver's share)."""

import dataclasses

import pytest

from hpsray.job import JobConfig
from hpsray.plan import make_plan
from hpsray.plan.calibrate import STAGES, Calibration, bottleneck, predict_rate
from hpsray.plan.pipeline_cost import RunPoint, StageCosts, apply_costs, fit_costs, load_costs, machine_key, save_costs
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


# -- what the stage actors add (hpsray/plan/pipeline_cost.py) ---------------------------------

WORK = {"read": 0.010, "pull": 0.020, "load": 0.030, "train": 0.040}  # engines alone, s per batch
BARE = StageCosts(dict.fromkeys(STAGES, 0.0), dict.fromkeys(STAGES, 1.0), 0.0, "k")


def test_each_stage_pays_its_fixed_cost_per_batch():
    costs = dataclasses.replace(BARE, fixed_s={"read": 0.005, "pull": 0.027, "load": 0.025, "train": 0.042})
    per_batch, t, slowest = apply_costs(costs, WORK, cores=64)  # cores to spare: the slowest stage decides
    assert t == pytest.approx({"read": 0.015, "pull": 0.047, "load": 0.055, "train": 0.082})
    assert per_batch == pytest.approx(0.082) and slowest == "train"
    assert apply_costs(BARE, WORK, cores=64)[0] == pytest.approx(0.040)  # without them: the engine's 40 ms


def test_sharing_the_cores_stretches_each_stage_and_the_sum_over_the_cores_can_decide():
    stretched = dataclasses.replace(BARE, stretch={**dict.fromkeys(STAGES, 1.0), "train": 3.0})
    assert apply_costs(stretched, WORK, cores=64)[1]["train"] == pytest.approx(0.120)
    per_batch, t, slowest = apply_costs(BARE, WORK, cores=2)  # 100 ms of stages on 2 cores: 50 > 40
    assert per_batch == pytest.approx(0.050) and slowest == "cores"
    assert apply_costs(BARE, WORK, cores=1)[0] == pytest.approx(0.100)  # one core: the stages take turns


def test_the_driver_and_the_first_batch_cost_their_share():
    costs = dataclasses.replace(BARE, other_s=0.010)
    assert apply_costs(costs, WORK, cores=64)[0] == pytest.approx(0.050)
    assert apply_costs(costs, WORK, cores=64, batches=10)[0] == pytest.approx(0.050 + 0.100 / 10)
    assert apply_costs(costs, WORK, cores=64, batches=0)[0] == pytest.approx(0.050)  # an endless pass


def test_the_costs_are_fitted_back_from_reference_runs():
    truth = StageCosts(
        {"read": 0.009, "pull": 0.027, "load": 0.025, "train": 0.042},
        dict.fromkeys(STAGES, 3.5),  # the stages share the cores: one stretch
        0.011,
        "k",
    )

    def run(scale: float) -> RunPoint:
        work = {s: w * scale for s, w in WORK.items()}
        per_batch, t, _ = apply_costs(truth, work, cores=2, batches=20)
        return RunPoint(work, t, per_batch, 2, 20)

    fitted = fit_costs([run(1.0), run(4.0)], "k")
    assert fitted.fixed_s == pytest.approx(truth.fixed_s)
    assert fitted.stretch == pytest.approx(truth.stretch)
    assert fitted.other_s == pytest.approx(truth.other_s)
    # a busy stage that grows slower than its engine keeps k = 1 (sharing never speeds a stage up)
    flat = fit_costs(
        [RunPoint(WORK, {**WORK, "read": 0.02}, 0.2, 2), RunPoint(WORK | {"read": 0.02}, WORK, 0.2, 2)], "k"
    )
    assert flat.stretch["read"] == 1.0 and flat.fixed_s["read"] >= 0.0


def test_predict_rate_uses_the_costs():
    costs = dataclasses.replace(BARE, fixed_s=dict.fromkeys(STAGES, 1.0), other_s=0.5)
    rate, stages = predict_rate(ONE_SECOND_EACH, 1000, 1000, 1000, costs=costs, batches=4)
    assert stages == pytest.approx(dict.fromkeys(STAGES, 2.0))  # 1 s of engine + 1 s fixed
    assert rate == pytest.approx(1000 / (2.0 + 0.5 + 8.0 / 4))  # 4 cores: the slowest; + o + the first batch
    assert bottleneck(ONE_SECOND_EACH, stages, costs) in STAGES
    two = dataclasses.replace(ONE_SECOND_EACH, cores=2)
    assert bottleneck(two, predict_rate(two, 1000, 1000, 1000, costs=costs)[1], costs) == "cores"


def test_the_costs_are_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("HPSRAY_CACHE_DIR", str(tmp_path / "cache"))
    key = machine_key(2)
    assert load_costs(key) is None
    costs = dataclasses.replace(BARE, key=key, measured_at="2026-11-26T23:00:00Z", load=0.3, seconds=12.0)
    assert save_costs(costs) == str(tmp_path / "cache" / "plan-stage-costs.json")
    assert load_costs(key) == costs
    assert load_costs(machine_key(3)) is None  # other cores: measured again
    (tmp_path / "cache" / "plan-stage-costs.json").write_text("{not json")
    assert load_costs(key) is None


def test_a_plan_with_costs_says_where_its_rate_comes_from(tmp_path):
    job = JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 8_000, "slots": 6, "keys": 3000, "dense": 2, "seed": 5}},
            "model": {"dim": 4, "hidden": [8]},
            "tiers": {"mem_rows": 9000},
            "pipeline": {"batch_size": 2000, "minibatch_size": 500},
        },
        where="job.toml",
        base_dir=str(tmp_path),
    )
    costs = dataclasses.replace(BARE, fixed_s=dict.fromkeys(STAGES, 0.5), measured_at="then", load=1.0)
    plan = make_plan(job, 8_000, costs=costs)
    assert plan.stage_s_per_batch and min(plan.stage_s_per_batch.values()) >= 0.5
    assert plan.predicted_examples_per_s and plan.predicted_examples_per_s < 2000 / 0.5
    assert any("fixed 500/500/500/500 ms" in n for n in plan.notes)


def test_the_plan_command_times_the_stage_actors_once(tmp_path, monkeypatch):
    from hpsray.job import probe as plan_probe

    monkeypatch.setenv("HPSRAY_CACHE_DIR", str(tmp_path))
    runs = []

    def measure():
        runs.append(1)
        return dataclasses.replace(BARE, key=machine_key(plan_probe.node_cores()), other_s=0.001 * len(runs))

    monkeypatch.setattr(plan_probe, "measure", measure)
    first = plan_probe.stage_costs(quiet=True)
    assert plan_probe.stage_costs(quiet=True) == first and len(runs) == 1  # the cache, not a second run
    assert plan_probe.stage_costs(recalibrate=True, quiet=True).other_s == 0.002 and len(runs) == 2

    def broken():
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(plan_probe, "measure", broken)
    assert plan_probe.stage_costs(recalibrate=True, quiet=True) is None  # the plan goes on without them


def test_the_tiers_are_timed_on_the_jobs_own_pull_load_and_dump_sequence(tmp_path):
    """Pull and load are timed as the run meets them: MEM-PS at the job's budget over the sampled
    batches in the pipeline's order, over a new SSD-PS on the job's disk that gets exactly the
    job's evictions and loads (their sizes, overwrites and compactions), not a batch dumped into
    a store's first, cold fsync."""
    from hpsray.plan import calibrate as cal_mod
    from hpsray.plan.sample import read_sample

    job = JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 12_000, "slots": 6, "keys": 3000, "dense": 2, "seed": 5}},
            "model": {"dim": 4, "hidden": [8]},
            "tiers": {"mem_rows": 9000, "ssd_path": str(tmp_path / "ssd")},
            "pipeline": {"batch_size": 2000, "minibatch_size": 500},
        },
        where="job.toml",
        base_dir=str(tmp_path),
    )
    sample = read_sample(job, 12_000)
    seen = {"stores": 0}
    real = cal_mod._TimedStore.__init__

    def counting(self, store):
        real(self, store)
        seen["stores"] += 1

    mp = pytest.MonkeyPatch()
    mp.setattr(cal_mod._TimedStore, "__init__", counting)
    try:
        tiers = cal_mod._simulate_tiers(job, sample, job.train_config().row_width)
    finally:
        mp.undo()
    assert seen["stores"] == 1 + cal_mod.REPEATS  # a warm-up pass, then the passes timed
    assert 0.0 < tiers.hit_rate < 1.0
    for wall, cpu in (tiers.pull, tiers.load, tiers.dump):  # seconds per row: evictions and misses happened
        assert wall > 0.0 and cpu >= 0.0
    assert not any((tmp_path).glob("hpsray-plan-*"))  # the stores are removed


def test_the_engines_are_timed_with_sleeping_openmp_threads_as_in_the_actors():
    """The calibration's process lets idle OpenMP threads sleep, as the stage actors do (spinning
    ones timed pull and load 2-7x slower than the actors run them); a policy the user set wins."""
    import os
    import subprocess
    import sys

    probe = "import os, hpsray.plan.calibrate; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"
