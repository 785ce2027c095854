"""Bounded waits (issue 34): a collective whose peer stops answering, and a driver's wait on a
call that never finishes, end in :class:`FaultTimeout` within the timeout plus a bounded margin,
naming what was awaited. Real actors in a local Ray; about 20 s."""

from __future__ import annotations

import time

import pytest
import ray

from hpsray.cluster import faults
from hpsray.errors import FaultTimeout, caused_by

TIMEOUT_S = 4.0


@ray.remote(num_cpus=0)
class Member:
    def join(self, world: int, rank: int, name: str, timeout_s: float) -> bool:
        from hpsray.cluster.collective import CollectiveGroup

        self.group = CollectiveGroup(world, rank, name, timeout_s=timeout_s)
        return True

    def allreduce(self) -> float:
        import torch

        return float(self.group.allreduce_sum(torch.ones(4))[0])

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def test_a_collective_whose_peer_is_silent_raises_fault_timeout(local_ray):
    members = [Member.remote(), Member.remote()]
    ray.get([m.join.remote(2, r, "silent-peer", TIMEOUT_S) for r, m in enumerate(members)], timeout=120)
    assert ray.get([m.allreduce.remote() for m in members], timeout=60) == [2.0, 2.0]
    t0 = time.monotonic()
    waiting = members[0].allreduce.remote()  # rank 1 never joins this one
    with pytest.raises(Exception) as info:
        ray.get(waiting, timeout=TIMEOUT_S + faults.settle_seconds(TIMEOUT_S) + 30)
    took = time.monotonic() - t0
    assert caused_by(info.value, FaultTimeout), info.value
    assert "all-reduce of the dense gradient" in str(info.value) and "rank 0 of 2" in str(info.value)
    assert took < TIMEOUT_S + faults.settle_seconds(TIMEOUT_S) + 20, took
    for m in members:
        ray.kill(m)


def test_a_driver_wait_on_a_call_that_never_ends_raises_fault_timeout(local_ray):
    from hpsray.pipelines.edge import wait_all

    member = Member.remote()
    ray.get(member.__ray_ready__.remote(), timeout=60)
    t0 = time.monotonic()
    with pytest.raises(FaultTimeout) as info:
        wait_all([member.sleep.remote(60)], "a sleeping call", timeout_s=2.0)
    assert time.monotonic() - t0 < 2.0 + faults.settle_seconds(2.0) + 10
    assert info.value.waited_for.startswith("a sleeping call") and info.value.timeout_s == 2.0
    ray.kill(member)


def test_one_default_and_the_job_file_sets_it(tmp_path):
    from hpsray.job.build import cluster_kwargs
    from hpsray.job.sections import ClusterSection
    from hpsray.pipelines import SyncSettings

    assert ClusterSection().fault_timeout_s == SyncSettings().fault_timeout_s == faults.DEFAULT_FAULT_TIMEOUT_S
    with pytest.raises(ValueError, match="fault_timeout_s"):
        SyncSettings(fault_timeout_s=0)
    from hpsray.errors import ConfigError
    from hpsray.job import JobConfig

    job = tmp_path / "job.toml"
    job.write_text("[data.synthetic]\nrows = 100\n[cluster]\nfault_timeout_s = 12.5\n")
    assert cluster_kwargs(JobConfig.load(job))["sync"].fault_timeout_s == 12.5
    job.write_text("[data.synthetic]\nrows = 100\n[cluster]\nfault_timeout_s = 0\n")
    with pytest.raises(ConfigError, match="cluster.fault_timeout_s"):
        JobConfig.load(job)


def test_a_ref_given_twice_is_waited_for_once(local_ray):
    ref = ray.put(7)
    assert faults.get([ref, ref], "one object named twice", timeout_s=30) == [7, 7]  # ray.wait refuses duplicates
