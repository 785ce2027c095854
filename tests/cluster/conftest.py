"""Simulated multi-node Ray clusters (``ray.cluster_utils.Cluster``) for the cluster tests.

A process talks to one Ray cluster at a time: a module using these fixtures closes the
session's local Ray (``ray_local``) and starts it again, with the same options, when done.
"""

import pytest

from hpsray.cluster.runtime import FAST_CONNECT

LOCAL_RAY = dict(
    address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=FAST_CONNECT
)  # as tests/conftest.py


def _cluster(nodes: int):
    import ray

    from hpsray.cluster.simulated import SimulatedCluster

    had_local = ray.is_initialized()
    with SimulatedCluster(nodes, cpus_per_node=1) as cluster:
        yield cluster
    if had_local:
        ray.init(**LOCAL_RAY)


@pytest.fixture(scope="module")
def two_nodes_cluster():
    yield from _cluster(2)


@pytest.fixture(scope="module")
def three_nodes_cluster():
    yield from _cluster(3)


@pytest.fixture(scope="module")
def own_three_nodes_cluster():
    """A 3-node cluster for one module alone (its tests may remove nodes)."""
    yield from _cluster(3)
