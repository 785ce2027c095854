"""Placement: one reader, MEM-PS, SSD-PS and trainer actor per training node.

Every stage actor is pinned to its node (``NodeAffinitySchedulingStrategy``), named for the Ray
dashboard (``<pipeline>:<Stage>[node i]``), and runs one call at a time: the order of a
driver's calls on an actor is what keeps training BSP-exact (docs/architecture.md: invariant 2).
The SSD-PS actor is the load stage too: the driver's loads and MEM-PS's writes reach it as two
callers, whose calls Ray does not order against each other (``actors/memps.py`` says why that
is safe).
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
    ssd_dir: str
    reader: Any = None  # created by the first pass, then reopened for each later one

    def stage_actors(self) -> list:
        return [self.ssd, self.mem, self.trainer, *([self.reader] if self.reader is not None else [])]


def _options(node_id: str) -> dict:
    return dict(num_cpus=0, scheduling_strategy=on_node(node_id), max_concurrency=1)


def start_ssd(pipeline, index: int, node_id: str, directory: str, restore_from: str | None = None):
    """Node ``index``'s SSD-PS actor over ``directory`` (rebuilt from a snapshot first when
    ``restore_from`` names one)."""
    return (
        ray.remote(SSDPSShard)
        .options(name=f"{pipeline.name}:SSDPS[node {index}]", **_options(node_id))
        .remote(index, directory, pipeline.config.row_width, restore_from, **pipeline.ssd_stage.options)
    )


def start_mem(pipeline, index: int, node_id: str, ssd, admission_from: str | None = None):
    """Node ``index``'s MEM-PS actor, backed by its SSD-PS actor ``ssd`` (its admission counts
    from ``admission_from``, a checkpoint's, when given)."""
    config, stage = pipeline.config, pipeline.mem_stage
    return (
        ray.remote(MemPSShard)
        .options(name=f"{pipeline.name}:MemPS[node {index}]", **_options(node_id))
        .remote(
            index,
            ssd,
            config.row_width,
            config.row_init(),
            stage.capacity_rows,
            stage.capacity_bytes,
            admit_after=stage.admit_after,
            expire_after_batches=stage.expire_after_batches,
            admission_from=admission_from,
            dumps_in_flight=stage.dumps_in_flight,
            **stage.options,
        )
    )


def start_trainer(pipeline, index: int, node: dict, n_nodes: int):
    """Node ``index``'s trainer actor on Ray node ``node`` (one GPU of it on CUDA)."""
    t, source = pipeline.trainer_stage, pipeline.source
    capacity = t.hbm_capacity or 2 * pipeline.batch_size * max(source.n_slots, 1)
    threads = t.threads or max(1, int(node.get("Resources", {}).get("CPU", 0)) or (os.cpu_count() or 1))
    return (
        ray.remote(Trainer)
        .options(
            name=f"{pipeline.name}:Trainer[node {index}]", **trainer_resources(_options(node["NodeID"]), t.device, node)
        )
        .remote(
            index,
            n_nodes,
            pipeline.config,
            source.n_slots,
            source.n_dense,
            capacity,
            t.n_devices,
            t.device,
            t.model,
            threads,
        )
    )


def place_node(
    pipeline,
    index: int,
    node: dict,
    n_nodes: int,
    ssd_dir: str,
    restore_from: str | None = None,
    admission_from: str | None = None,
) -> NodeActors:
    """Start node ``index``'s SSD-PS (over ``ssd_dir``), MEM-PS and trainer on Ray node ``node``.

    ``pipeline`` gives the stages, config, source shape and the actor-name prefix.
    """
    node_id = node["NodeID"]
    ssd = start_ssd(pipeline, index, node_id, ssd_dir, restore_from)
    mem = start_mem(pipeline, index, node_id, ssd, admission_from)
    return NodeActors(index, node_id, ssd, mem, start_trainer(pipeline, index, node, n_nodes), ssd_dir)


def open_reader(pipeline, node: NodeActors, source, index: int, count: int, n_nodes: int, skip: int = 0):
    """Node ``node``'s reader, reading share ``index`` of ``count`` of ``source`` from now on,
    past its first ``skip`` batches."""
    if node.reader is None:
        opts = dict(num_cpus=0, scheduling_strategy=on_node(node.node_id))
        node.reader = (
            ray.remote(Reader)
            .options(name=f"{pipeline.name}:Reader[node {node.index}]", **opts)
            .remote(source, pipeline.batch_size, node.index, index, count, pipeline.transforms, n_nodes, skip)
        )
    else:  # actor tasks from this driver run in order: the pass's reads come after this
        node.reader.open.remote(source, pipeline.batch_size, index, count, skip)
    return node.reader


def join_group(name: str, nodes: list[NodeActors], sync, generation: int = 0) -> list:
    """Form the trainers' collective group (and the chunk aggregators, or the clock board of
    ``propagation = "relay"``, that ``sync`` asks for); returns those helper actors, for
    shutdown. A recovery that restarts the trainers forms a new group: ``generation`` counts
    them."""
    helpers: list = []
    aggregators = None
    if sync.dense == "chunked":
        from hpsray.cluster.aggregation import start_aggregators

        aggregators = start_aggregators(len(nodes), node_ids=[n.node_id for n in nodes], name_prefix=name)
        helpers += list(aggregators)
    board = None
    if sync.consistency != "bsp" and sync.propagation == "relay":  # push and pull: the trainers' own mailboxes
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
    group = f"{name}:trainers" + (f"#{generation}" if generation else "")
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
