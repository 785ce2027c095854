"""Joining Ray: an embedded local instance by default, or an existing cluster.

With no address (and no ``RAY_ADDRESS``) hpsray starts a local Ray. Ray 2.60 then turns on
token authentication and writes ``~/.ray/auth_token``; later ``ray start`` / ``ray job submit``
against such a cluster need ``RAY_AUTH_MODE=token`` (docs/operations.md).
"""

from __future__ import annotations

import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def connect(address: str | None = None, **init_options) -> bool:
    """Make sure this process is connected to Ray; returns True if it started Ray itself."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    options = {"log_to_driver": True, **init_options}
    if address:
        ray.init(address=address, **options)
    else:
        # Ray starts its workers at niceness 15; the embedded instance exists only for this job,
        # whose trainer must not yield its cores to whatever else runs on the machine
        options.setdefault("_system_config", {"worker_niceness": 0})
        ray.init(address="local", **options)
    return True


def alive_nodes() -> list[dict]:
    """Alive Ray nodes, the driver's own node first, then by node id."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (n["NodeID"] != here, n["NodeID"]))


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    """Scheduling strategy that pins an actor to one node."""
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


NODE_RESOURCE = "hpsray_node"


def training_nodes() -> list[dict]:
    """The nodes that may host an hpsray node (MEM-PS, SSD-PS, trainer, readers).

    Nodes offering the custom resource ``hpsray_node`` when the cluster marks any (the cluster
    launcher and KubeRay examples give it to the workers, so a head without disks stays out);
    otherwise every alive node. Order as :func:`alive_nodes`.
    """
    nodes = alive_nodes()
    marked = [n for n in nodes if n.get("Resources", {}).get(NODE_RESOURCE, 0) > 0]
    return marked or nodes
