"""Where the device processes of a CUDA trainer land: one GPU each, two on one host never the
same. Ray hands out GPU ids by its resource count, so a node that declares two GPUs shows the
placement without any GPU (the compute itself is checked by the ``gpu``-marked tests)."""

import os

import pytest
import ray

from hpsray.actors.devices import device_options
from hpsray.cluster.runtime import FAST_CONNECT
from hpsray.errors import ConfigError
from hpsray.pipelines.placement import release_placements, trainer_placement

LOCAL_RAY = dict(
    address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=FAST_CONNECT
)  # as tests/conftest.py


@pytest.fixture(scope="module")
def two_gpu_node():
    from ray.cluster_utils import Cluster

    had_local = ray.is_initialized()
    if had_local:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    yield next(n for n in ray.nodes() if n["Alive"])
    ray.shutdown()
    cluster.shutdown()
    if had_local:
        ray.init(**LOCAL_RAY)


@ray.remote
class Probe:
    def gpus(self) -> tuple:
        return tuple(ray.get_gpu_ids()), os.environ.get("CUDA_VISIBLE_DEVICES")


def test_two_device_processes_get_two_gpus(two_gpu_node):
    base = {"num_cpus": 0, "max_concurrency": 1}
    opts, group = trainer_placement(base, "cuda", two_gpu_node, 2, "job:Trainer[node 0]")
    try:
        first = Probe.options(**opts).remote()  # device 0: the trainer the pipeline calls
        second = Probe.options(**device_options(1, group, two_gpu_node["NodeID"])).remote()  # device 1: its worker
        (ids0, visible0), (ids1, visible1) = ray.get([first.gpus.remote(), second.gpus.remote()])
        assert len(ids0) == len(ids1) == 1 and ids0 != ids1
        assert visible0 != visible1 and {visible0, visible1} == {str(ids0[0]), str(ids1[0])}
    finally:
        release_placements("job:")


def test_more_devices_than_the_node_has_gpus_is_a_clear_error(two_gpu_node):
    with pytest.raises(ConfigError, match=r"n_devices.*3 device\(s\) per node but the node offers 2 GPU"):
        trainer_placement({}, "cuda", two_gpu_node, 3, "job:Trainer[node 0]")
    cpu_node = {**two_gpu_node, "Resources": {"CPU": 1.0}}
    with pytest.raises(ConfigError, match="offers no GPU"):
        trainer_placement({}, "cuda", cpu_node, 1, "job:Trainer[node 0]")
    assert trainer_placement({"num_cpus": 0}, "cpu", cpu_node, 4, "job:Trainer[node 0]") == ({"num_cpus": 0}, None)
