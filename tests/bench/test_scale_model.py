"""The scaling model of ``hpsray bench scale`` on hosts with cores of their own
(hpsray.bench.scale_model, its docstring's ``path`` and ``cpu``)."""

import pytest

from hpsray.bench.scale_model import hits, project, project_on_cores, terms_on_cores

PROBE = {"round_s": 0.008, "round_cpu_s": 0.006, "transfer_s": 0.01, "transfer_cpu_s": 0.007}


def costs(cores=1, host=0.25, trainer=0.15, period=0.25, probe=PROBE):
    return {
        "examples": 5000,
        "steps": 5,
        "dense_bytes": 1.5e6,
        "sparse_bytes": 0.9e6,
        "distinct_keys": 45000,
        "row_bytes": 128,
        "read_s": 0.08,
        "pull_s": 0.03,
        "load_s": 0.01,
        "train_s": 0.2,
        "period_s": period,
        "host_cpu_s": host,
        "trainer_cpu_s": trainer,
        "cores": cores,
        "probe": probe,
    }


def test_one_host_projects_its_own_measured_period():
    c = costs()
    assert project(c, 1, 1e9, 1e-4, 1.0) == pytest.approx(5000 / 0.25)


def test_hits_count_one_stretch_for_one_host_and_never_more_than_there_are():
    assert hits(1, 5) == pytest.approx(1.0)
    assert hits(2, 5) == pytest.approx(1.8)
    assert hits(2, 5) < hits(3, 5) < hits(100, 5) <= 5


def test_two_hosts_add_the_exchange_and_the_other_hosts_interruptions_to_the_trainers_path():
    c = costs()
    t = terms_on_cores(c, 2, 1e9, 1e-4, 1.0)
    interrupt = 0.25 - 0.15  # the other stages share the trainer's one core
    assert t["interrupt_s"] == pytest.approx(interrupt)
    expected = 0.25 - interrupt + 5 * 0.008 + 2 * 0.01 + interrupt * 1.8
    assert t["path_s"] == pytest.approx(expected)
    assert t["cpu_s"] == pytest.approx(0.25 + 5 * 0.006 + 3 * 0.007)
    assert project_on_cores(c, 2, 1e9, 1e-4, 1.0) == pytest.approx(2 * 5000 / expected)


def test_with_cores_to_spare_the_other_stages_do_not_stall_the_trainers():
    c = costs(cores=2, host=0.3, trainer=0.2, period=0.2)
    t = terms_on_cores(c, 2, 1e9, 1e-4, 1.0)
    assert t["interrupt_s"] == 0.0
    assert t["path_s"] == pytest.approx(0.2 + 5 * 0.008 + 2 * 0.01)


def test_the_cpu_bound_decides_when_the_hosts_cores_are_the_bottleneck():
    slow_cpu = {**PROBE, "round_cpu_s": 0.05}  # an exchange that costs more CPU than wall time
    c = costs(probe=slow_cpu)
    t = terms_on_cores(c, 2, 1e9, 1e-4, 1.0)
    assert t["cpu_s"] > t["path_s"]
    assert project(c, 2, 1e9, 1e-4, 1.0) == pytest.approx(2 * 5000 / t["cpu_s"])


def test_without_the_probe_the_wire_only_model_is_used():
    c = costs(probe=None)
    assert project(c, 1, 1e9, 1e-4, 1.0) == pytest.approx(5000 / 0.2)  # the slowest stage, train
