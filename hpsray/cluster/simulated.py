"""A multi-node Ray cluster on one machine, for tests and ``hpsray bench scale``.

Each simulated node is a real raylet with its own node id, object store and resources
(``ray.cluster_utils.Cluster``); actors placed by node id land on it exactly as on real nodes.
Only the network is missing: every node shares this machine's cores and loopback.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.cluster_utils import Cluster

from hpsray.cluster.runtime import FAST_CONNECT


class SimulatedCluster:
    """``nodes`` Ray nodes on this machine; the driver connects to it on ``__enter__``.

    A Ray connection of this process that is already open is closed first (a driver talks
    to one cluster at a time).
    """

    def __init__(self, nodes: int, cpus_per_node: int = 1, object_store_bytes: int = 200 * 1024**2) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {nodes}")
        self.nodes, self.cpus_per_node, self.object_store_bytes = nodes, cpus_per_node, object_store_bytes
        self.cluster: Cluster | None = None

    def __enter__(self) -> SimulatedCluster:
        if ray.is_initialized():
            ray.shutdown()
        args: dict[str, Any] = {"num_cpus": self.cpus_per_node, "object_store_memory": self.object_store_bytes}
        self.cluster = cluster = Cluster(
            initialize_head=True, head_node_args={**args, "include_dashboard": False, "_system_config": FAST_CONNECT}
        )
        for _ in range(self.nodes - 1):
            cluster.add_node(**args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        return self

    @property
    def address(self) -> str:
        if self.cluster is None:
            raise RuntimeError("the simulated cluster runs only inside its `with` block")
        return self.cluster.address

    def __exit__(self, *exc: object) -> None:
        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
