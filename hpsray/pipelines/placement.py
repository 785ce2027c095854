"""Placement: one reader, MEM-PS, SSD-PS and trainer actor per training node.

Every stage actor is pinned to its node (``NodeAffinitySchedulingStrategy``), named for the Ray
dashboard (``<pipeline>:<Stage>[node i]``), and runs one call at a time: the order of a
driver's calls on an actor is what keeps training BSP-exact (docs/architecture.md: invariant 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray

from hpsray.actors.memps import MemPSShard
from hpsray.actors.reader import Reader
from hpsray.actors.ssdps import SSDPSShard
from hpsray.actors.trainer import Trainer
from hpsray.cluster.runtime import on_node
from hpsray.errors import ConfigError


@dataclass
class NodeActors:
    """The stage actors of one training node."""

    index: int
    node_id: str
    ssd: Any
    mem: Any
    trainer: Any
    reader: Any = None  # created by the first pass, then reopened for each later one

    def stage_actors(self) -> list:
        return [self.ssd, self.mem, self.trainer, *([self.reader] if self.reader is not None else [])]


def place_node(
    pipeline, index: int, node: dict, n_nodes: int, ssd_dir: str, capacity: int, ssd_options: dict | None = None
) -> NodeActors:
    """Start node ``index``'s SSD-PS (over ``ssd_dir``), MEM-PS and trainer on Ray node ``node``.

    ``pipeline`` gives the stages, config, source shape and the actor-name prefix;
    ``ssd_options`` overrides the SSD-PS stage's options (a restore, say).
    """
    t, name = pipeline.trainer_stage, pipeline.name
    config = pipeline.config
    opts = dict(num_cpus=0, scheduling_strategy=on_node(node["NodeID"]), max_concurrency=1)
    threads = t.threads or max(1, int(node.get("Resources", {}).get("CPU", 0)) or (os.cpu_count() or 1))
    ssd = (
        ray.remote(SSDPSShard)
        .options(name=f"{name}:SSDPS[node {index}]", **opts)
        .remote(index, ssd_dir, config.row_width, **(pipeline.ssd_stage.options | (ssd_options or {})))
    )
    mem_stage = pipeline.mem_stage
    mem = (
        ray.remote(MemPSShard)
        .options(name=f"{name}:MemPS[node {index}]", **opts)
        .remote(
            index,
            ssd,
            config.row_width,
            config.row_init(),
            mem_stage.capacity_rows,
            mem_stage.capacity_bytes,
            **mem_stage.options,
        )
    )
    source = pipeline.source
    trainer = (
        ray.remote(Trainer)
        .options(name=f"{name}:Trainer[node {index}]", **trainer_resources(opts, t.device, node))
        .remote(
            index, n_nodes, config, source.n_slots, source.n_dense, capacity, t.n_devices, t.device, t.model, threads
        )
    )
    return NodeActors(index, node["NodeID"], ssd, mem, trainer)


def open_reader(pipeline, node: NodeActors, source, index: int, count: int, n_nodes: int):
    """Node ``node``'s reader, reading share ``index`` of ``count`` of ``source`` from now on."""
    if node.reader is None:
        opts = dict(num_cpus=0, scheduling_strategy=on_node(node.node_id))
        node.reader = (
            ray.remote(Reader)
            .options(name=f"{pipeline.name}:Reader[node {node.index}]", **opts)
            .remote(source, pipeline.batch_size, node.index, index, count, pipeline.transforms, n_nodes)
        )
    else:  # actor tasks from this driver run in order: the pass's reads come after this
        node.reader.open.remote(source, pipeline.batch_size, index, count)
    return node.reader


def join_group(name: str, nodes: list[NodeActors], sync) -> list:
    """Form the trainers' collective group (and the chunk aggregators or the clock board that
    ``sync`` asks for); returns those helper actors, for shutdown."""
    helpers: list = []
    aggregators = None
    if sync.dense == "chunked":
        from hpsray.cluster.aggregation import start_aggregators

        aggregators = start_aggregators(len(nodes), node_ids=[n.node_id for n in nodes], name_prefix=name)
        helpers += list(aggregators)
    board = None
    if sync.consistency != "bsp":
        from hpsray.cluster.consistency import ClockBoard

        board = (
            ray.remote(ClockBoard)
            .options(
                name=f"{name}:ClockBoard",
                num_cpus=0,
                scheduling_strategy=on_node(nodes[0].node_id),
                max_concurrency=1000,
            )
            .remote(len(nodes))
        )
        helpers.append(board)
    group = f"{name}:trainers"
    ray.get([n.trainer.join.remote(len(nodes), group, sync, aggregators, board) for n in nodes])
    return helpers


def trainer_resources(opts: dict, device: str, node: dict) -> dict:
    """The trainer actor's options: on CUDA it asks Ray for one GPU of its node, so Ray sets
    ``CUDA_VISIBLE_DEVICES`` and two trainers on one host never share a GPU."""
    if device != "cuda":
        return opts
    gpus = node.get("Resources", {}).get("GPU", 0)
    if gpus < 1:
        raise ConfigError(
            f"Ray node {node.get('NodeManagerAddress', node['NodeID'])}",
            "pipeline.device",
            f"'cuda' but the node offers no GPU (its resources: {', '.join(sorted(node.get('Resources', {})))}); "
            "start it with GPUs visible (ray start --num-gpus=N) or train with device = 'cpu'",
        )
    return {**opts, "num_gpus": 1}
