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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from hpsray.actors.ahead import trainer_actor
from hpsray.actors.cpu import yield_cores
from hpsray.actors.memps import MemPSShard
from hpsray.actors.reader import Reader
from hpsray.actors.ssdps import actor_class as ssd_actor_class
from hpsray.actors.trainer import Trainer
from hpsray.cluster.runtime import on_node
from hpsray.errors import ConfigError
from hpsray.pipelines.settings import SyncSettings
from hpsray.pipelines.sources import PipelineSource
from hpsray.pipelines.views import Placed
from hpsray.tables import TagKeys, table_admission
from hpsray.tiers.cache_policy import DEFAULT_HISTORY
from hpsray.tiers.padded import group_capacities
from hpsray.tiers.rowgroups import RowGroups


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


def _yielding(pipeline: Placed, actor: Any) -> Any:
    """``actor`` (a read, pull or load stage), made ``stage_niceness`` steps nicer than the
    trainer, and ``SCHED_IDLE`` with ``stage_idle``, once it is up (its first call after
    construction; not waited for)."""
    steps, idle = pipeline.trainer_settings.stage_niceness, pipeline.trainer_settings.stage_idle
    if steps or idle:
        actor.__ray_call__.remote(yield_cores, steps, idle)
    return actor


def _named(make: Callable[[], Any], wait_s: float = 30.0) -> Any:
    """``make()``, which starts a named actor, tried again while the name still belongs to the
    actor a recovery just stopped: Ray frees a killed actor's name only once the cluster has
    recorded its death, a moment after the kill (longer on a loaded machine). Names are unique
    per pipeline, so no other job's actor can hold it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return make()
        except ray.exceptions.ActorAlreadyExistsError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start_ssd(pipeline: Placed, index: int, node_id: str, directory: str, restore_from: str | None = None) -> Any:
    """Node ``index``'s SSD-PS actor over ``directory`` (rebuilt from a snapshot first when
    ``restore_from`` names one)."""
    return _yielding(
        pipeline,
        _named(
            lambda: (
                ssd_actor_class()  # MEM-PS's writes on a thread beside the loads
                .options(name=f"{pipeline.name}:SSDPS[node {index}]", **_options(node_id))
                .remote(
                    index,
                    directory,
                    pipeline.config.row_width,
                    restore_from,
                    groups=RowGroups.of_config(pipeline.config, pipeline.source.n_slots),
                    **pipeline.ssd_settings.options,
                )
            )
        ),
    )


def group_shares(source: Any, config: Any, groups: RowGroups, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """From the source's first batches (read here, on the driver), per row group: the distinct
    keys of two batches in a row (its pinned rows while they are in flight, the most over the
    first three batches), and its share of their keys: how MEM-PS splits its budget among the
    groups. By the groups' slots when the source gives no batch."""
    tables = config.tables_for(source.n_slots)
    keys = []
    tag = TagKeys(tables)  # as the readers tag them: copied slots appended first
    for batch in source.open(batch_size):
        keys.append(np.unique(tag(batch).keys))
        if len(keys) == 3:
            break
    if not keys:
        slots = np.bincount(groups.slot_groups(tables.slot_table), minlength=len(groups)).astype(np.float64)
        return np.zeros(len(groups)), slots
    pairs = [np.union1d(a, b) for a, b in zip(keys, keys[1:])] or keys
    need = np.max([np.bincount(groups.group_of(k), minlength=len(groups)) for k in pairs], axis=0)
    share = np.bincount(groups.group_of(np.concatenate(keys)), minlength=len(groups)).astype(np.float64) + 1.0
    return need.astype(np.float64), share


def start_mem(pipeline: Placed, index: int, node_id: str, ssd: Any, admission_from: str | None = None) -> Any:
    """Node ``index``'s MEM-PS actor, backed by its SSD-PS actor ``ssd`` (its admission counts
    from ``admission_from``, a checkpoint's, when given)."""
    config, stage = pipeline.config, pipeline.mem_settings
    groups = RowGroups.of_config(config, pipeline.source.n_slots)
    by_group = None
    if groups is not None:  # tables of several row layouts: the budget split among the groups
        need, share = group_shares(pipeline.source, config, groups, pipeline.batch_size)
        history = stage.options.get("history", DEFAULT_HISTORY)
        capacities = group_capacities(groups, need, share, stage.capacity_rows, stage.capacity_bytes, history)
        by_group = (groups, capacities)
    return _yielding(
        pipeline,
        _named(
            lambda: (
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
                    per_table_admission=table_admission(
                        config, pipeline.source.n_slots, stage.admit_after, stage.expire_after_batches
                    ),
                    admission_from=admission_from,
                    dumps_in_flight=stage.dumps_in_flight,
                    groups=by_group,
                    **stage.options,
                )
            )
        ),
    )


def start_trainer(pipeline: Placed, index: int, node: dict, n_nodes: int) -> Any:
    """Node ``index``'s trainer actor on Ray node ``node`` (one GPU of it on CUDA), device 0 of
    the node's ``n_devices``; it starts the node's other device processes itself."""
    t, source = pipeline.trainer_settings, pipeline.source
    capacity = t.hbm_capacity or 2 * pipeline.batch_size * pipeline.model_slots
    cpus = int(node.get("Resources", {}).get("CPU", 0)) or (os.cpu_count() or 1)
    threads = t.threads or max(1, cpus // t.n_devices)
    name = f"{pipeline.name}:Trainer[node {index}]"
    opts, group = trainer_placement(_options(node["NodeID"]), t.device, node, t.n_devices, name)
    return _named(
        lambda: (
            trainer_actor(Trainer)
            .options(name=name, **opts)
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
                placement=group,
                name=name,
            )
        )
    )


def place_node(
    pipeline: Placed,
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
    trainer = start_trainer(pipeline, index, node, n_nodes)  # first: the slowest to start (torch, its warm-up)
    ssd = start_ssd(pipeline, index, node_id, ssd_dir, restore_from)
    mem = start_mem(pipeline, index, node_id, ssd, admission_from)
    return NodeActors(index, node_id, ssd, mem, trainer, ssd_dir)


def open_reader(
    pipeline: Placed, node: NodeActors, source: PipelineSource, index: int, count: int, n_nodes: int, skip: int = 0
) -> Any:
    """Node ``node``'s reader, reading share ``index`` of ``count`` of ``source`` from now on,
    past its first ``skip`` batches."""
    if node.reader is None:
        node.reader = start_reader(pipeline, node, source, index, count, n_nodes, skip)
    else:  # actor tasks from this driver run in order: the pass's reads come after this
        node.reader.open.remote(source, pipeline.batch_size, index, count, skip)
    return node.reader


def start_reader(
    pipeline: Placed,
    node: NodeActors,
    source: PipelineSource,
    index: int,
    count: int,
    n_nodes: int,
    skip: int = 0,
    role: str = "Reader",
) -> Any:
    """A new reader actor on ``node`` named ``{pipeline.name}:{role}[node i]``, reading share
    ``index`` of ``count`` of ``source``, past its first ``skip`` batches."""
    opts = dict(num_cpus=0, scheduling_strategy=on_node(node.node_id))
    trainer = pipeline.trainer_settings
    index_here = role == "Reader" and trainer.index_in_read(_cpus_of(node.node_id))
    minibatch = trainer.config.minibatch_size if index_here else None
    return _yielding(
        pipeline,
        _named(
            lambda: (
                ray.remote(Reader)
                .options(name=f"{pipeline.name}:{role}[node {node.index}]", **opts)
                .remote(
                    source, pipeline.batch_size, node.index, index, count, pipeline.transforms, n_nodes, skip, minibatch
                )
            )
        ),
    )


def _cpus_of(node_id: str) -> float:
    """The CPUs Ray counts on node ``node_id`` (0 when it is gone)."""
    return next((float(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["NodeID"] == node_id), 0.0)


def join_group(name: str, nodes: list[NodeActors], sync: SyncSettings, generation: int = 0, n_devices: int = 1) -> list:
    """Form the trainers' collective group (and the chunk aggregators, or the clock board of
    ``propagation = "relay"``, that ``sync`` asks for), or with ``n_devices > 1`` the device
    mesh of every node's device processes; returns the helper actors, for shutdown. A recovery
    that restarts the trainers forms a new group: ``generation`` counts them."""
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
    mesh = ray.get(nodes[0].trainer.mesh_address.remote()) if n_devices > 1 else None
    ray.get([n.trainer.join.remote(len(nodes), group, sync, aggregators, board, mesh) for n in nodes])
    return helpers


def needs_group(n_nodes: int, n_devices: int) -> bool:
    """Whether the trainers form a group: several nodes, or several devices per node."""
    return n_nodes > 1 or n_devices > 1


_GROUPS: dict[str, Any] = {}  # trainer name -> its node's placement group (CUDA, several devices)


def trainer_placement(opts: dict, device: str, node: dict, n_devices: int = 1, name: str = "") -> tuple[dict, Any]:
    """The trainer actor's options, and the placement group its device processes use.

    On CUDA every device process asks Ray for one GPU of the node, so Ray sets
    ``CUDA_VISIBLE_DEVICES`` and two trainers on one host never share a GPU; with
    ``n_devices > 1`` a placement group of ``n_devices`` one-GPU bundles on the node holds
    them (device ``d`` in bundle ``d``; a trainer started again under ``name`` releases the
    previous one's group). On CPU: ``opts`` unchanged, no group.
    """
    if device != "cuda":
        return opts, None
    gpus = node.get("Resources", {}).get("GPU", 0)
    if gpus < n_devices:
        have = f"{gpus:g} GPU" if gpus else "no GPU"
        raise ConfigError(
            f"Ray node {node.get('NodeManagerAddress', node['NodeID'])}",
            "pipeline.device" if n_devices == 1 else "pipeline.n_devices",
            f"'cuda' with {n_devices} device(s) per node but the node offers {have} "
            f"(its resources: {', '.join(sorted(node.get('Resources', {})))}); "
            "start it with GPUs visible (ray start --num-gpus=N), lower n_devices, or train with device = 'cpu'",
        )
    if n_devices == 1:
        return {**opts, "num_gpus": 1}, None
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if name in _GROUPS:
        remove_placement_group(_GROUPS.pop(name))
    here = {f"node:{node['NodeManagerAddress']}": 0.001} if node.get("NodeManagerAddress") else {}
    group = placement_group([{"GPU": 1, **here}] * n_devices, strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=120)
    _GROUPS[name] = group
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return {**opts, "num_gpus": 1, "scheduling_strategy": strategy}, group


def release_placements(prefix: str) -> None:
    """Remove the placement groups of the trainers whose names start with ``prefix``."""
    from ray.util.placement_group import remove_placement_group

    for name in [n for n in _GROUPS if n.startswith(prefix)]:
        try:
            remove_placement_group(_GROUPS.pop(name))
        except Exception:  # noqa: BLE001,S112 - Ray is gone with it
            continue


_STAGES = ("read", "pull", "load", "train")


def wait_ready(
    nodes: list[NodeActors], stages: tuple[str, ...] = _STAGES, since: float | None = None
) -> dict[str, float]:
    """Wait until the stage actors of ``stages`` are up; returns the seconds from ``since`` (a
    ``time.perf_counter()``; default: this call) until each stage's slowest actor was, the
    start's breakdown in the report."""
    t0 = time.perf_counter() if since is None else since
    stage = {}
    for node in nodes:
        for name, actor in zip(_STAGES, (node.reader, node.mem, node.ssd, node.trainer)):
            if actor is not None and name in stages:
                stage[actor.__ray_ready__.remote()] = name
    ready: dict[str, float] = {}
    pending = list(stage)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises an actor's failed start
        ready[stage[done[0]]] = time.perf_counter() - t0
    return ready


def actor_handles(nodes: list[NodeActors]) -> dict[str, Any]:
    """The stage actors of ``nodes`` by dashboard name (``SSDPS[node 0]``, ...)."""
    out: dict[str, Any] = {}
    for n in nodes:
        out.update(
            {f"SSDPS[node {n.index}]": n.ssd, f"MemPS[node {n.index}]": n.mem, f"Trainer[node {n.index}]": n.trainer}
        )
        if n.reader is not None:
            out[f"Reader[node {n.index}]"] = n.reader
    return out


def stop_actors(nodes: list[NodeActors], aggregators: list[Any]) -> None:
    """Close each node's SSD-PS store (a dead one is skipped), then kill every stage actor and
    ``aggregators``."""
    for n in nodes:
        try:
            ray.get(n.ssd.close.remote())
        except Exception:  # noqa: BLE001 - a dead store has nothing left to close
            pass
        for a in [n.mem, n.trainer, n.ssd, *([n.reader] if n.reader is not None else [])]:
            ray.kill(a)
    for a in aggregators:
        ray.kill(a)


def scan_rows(nodes: list[NodeActors], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Every row of ``nodes`` ``(keys sorted, float32[n, width])``: each MEM-PS flushed to its
    SSD-PS, then each SSD-PS scanned."""
    keys, rows = [], []
    for node in nodes:
        ray.get(node.mem.flush.remote())
        for k, r in ray.get(node.ssd.scan.remote()):
            keys.append(k)
            rows.append(r)
    if not keys:
        return np.empty(0, np.uint64), np.empty((0, width), np.float32)
    k, r = np.concatenate(keys), np.concatenate(rows)
    order = np.argsort(k)
    return k[order], r[order]
