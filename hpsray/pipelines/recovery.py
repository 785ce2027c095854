"""Checkpoints of a running pipeline and recovery from a dead actor (docs/operations.md:
Checkpoints and recovery).

A checkpoint is taken at a batch boundary where every trained batch is written back: MEM-PS
flushes its changed rows to SSD-PS, each node's SSD-PS references its (immutable) parameter
files in the checkpoint, each trainer saves its dense state, and the driver commits the
checkpoint atomically (:mod:`hpsray.checkpoint`). In object storage each node's SSD-PS actor
uploads that node's files from its host before the driver writes the manifest, and a restore
first brings each node's files onto its host (:func:`fetch_shards`). Everything else is
derived: HBM-PS and the MEM-PS cache refill from SSD-PS, and the readers skip the batches
already trained.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    NodeDiedError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    WorkerCrashedError,
)

from hpsray.checkpoint import Checkpoint, Checkpoints, node_dir
from hpsray.checkpoint.remote import HOST_MARK, RemoteCheckpoints, fetch_node
from hpsray.checkpoint.reshard import ADMISSION, SSD_SNAPSHOT, TRAINER_STATE, checkpoint_nodes, reshard
from hpsray.cluster.runtime import training_nodes
from hpsray.errors import FaultTimeout, NoSpareNode, caused_by
from hpsray.pipelines.placement import (
    NodeActors,
    join_group,
    needs_group,
    place_node,
    release_placements,
    start_mem,
    start_ssd,
    start_trainer,
)

ACTOR_LOST = (
    ActorDiedError,
    ActorUnavailableError,
    NodeDiedError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    WorkerCrashedError,
    FaultTimeout,  # a peer silent past cluster.fault_timeout_s: handled as lost (issue 34)
)


@dataclass
class CheckpointCosts:
    """Seconds and bytes of the checkpoints one ``fit()`` wrote."""

    seconds: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)

    def summary(self, wall: float) -> dict:
        total = sum(self.seconds)
        return {
            "count": len(self.seconds),
            "seconds": total,
            "mean_seconds": total / len(self.seconds) if self.seconds else 0.0,
            "share_of_wall": total / wall if wall > 0 else 0.0,
            "bytes": sum(self.bytes),
        }


def write_checkpoint(
    checkpoints: Checkpoints, nodes: list[NodeActors], batch: int, meta: dict, fingerprint: str
) -> tuple[Checkpoint, float, int]:
    """Checkpoint the state after ``batch`` batches (every write-back done): returns the
    checkpoint, its seconds and bytes referenced."""
    t0 = time.perf_counter()
    with checkpoints.staged(batch) as staging:
        ray.get([n.mem.flush.remote() for n in nodes])
        snaps = [n.ssd.snapshot.remote(str(node_dir(staging, n.index) / SSD_SNAPSHOT)) for n in nodes]
        states = [n.trainer.save_state.remote(str(node_dir(staging, n.index) / TRAINER_STATE)) for n in nodes]
        snapped, saved = ray.get(snaps), ray.get(states)
        saved += ray.get([n.mem.save_admission.remote(str(node_dir(staging, n.index) / ADMISSION)) for n in nodes])
        record = {**meta, "nodes": len(nodes)}
        if isinstance(checkpoints, RemoteCheckpoints):  # each node uploads its files from its host
            token = uuid.uuid4().hex
            (staging / HOST_MARK).write_text(token)
            uploads = [n.ssd.upload_checkpoint.remote(checkpoints.location, str(staging), token) for n in nodes]
            uploaded = ray.get(uploads)
            (staging / HOST_MARK).unlink()
            ckpt = checkpoints.commit(staging, batch, record, fingerprint=fingerprint, uploaded=uploaded)
        else:
            ckpt = checkpoints.commit(staging, batch, record, fingerprint=fingerprint)
    return ckpt, time.perf_counter() - t0, sum(s["bytes"] for s in snapped) + sum(saved)


def fetch_shards(checkpoints: Checkpoints | None, checkpoint: Checkpoint, placed: list[tuple[int, str]]) -> list[dict]:
    """Bring each node's files of ``checkpoint`` onto its host before its actors restore from
    them: for checkpoints in object storage, a task on each ``(node index, Ray node id)`` of
    ``placed`` downloads what that host lacks (:func:`~hpsray.checkpoint.remote.fetch_node`);
    returns what each downloaded (nothing for a local checkpoint directory)."""
    if not isinstance(checkpoints, RemoteCheckpoints):
        return []
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    plan = checkpoints.shard_plan(checkpoint)
    task = ray.remote(num_cpus=0)(fetch_node)
    return ray.get(
        [
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(plan, i)
            for i, node_id in placed
        ]
    )


def snapshot_of(checkpoint: Checkpoint, node: int) -> str:
    """Node ``node``'s SSD-PS snapshot in ``checkpoint``."""
    return str(checkpoint.node(node) / SSD_SNAPSHOT)


def admission_of(checkpoint: Checkpoint, node: int) -> str | None:
    """Node ``node``'s admission counts in ``checkpoint`` (``None`` when admission was off)."""
    path = checkpoint.node(node) / ADMISSION
    return str(path) if path.exists() else None


def trainer_state_of(checkpoint: Checkpoint, node: int) -> str:
    return str(checkpoint.node(node) / TRAINER_STATE)


def load_trainers(checkpoint: Checkpoint, nodes: list[NodeActors]) -> None:
    ray.get([n.trainer.load_state.remote(trainer_state_of(checkpoint, n.index)) for n in nodes])


def reshape(checkpoints: Checkpoints, checkpoint: Checkpoint, nodes: int, ssd_options: dict) -> tuple:
    """``checkpoint`` on ``nodes`` nodes (:func:`~hpsray.checkpoint.reshard.reshard`, committed in
    its place) and what was done (``None`` when it has that shape already)."""
    old = checkpoint_nodes(checkpoint)
    if old == nodes:
        return checkpoint, None
    t0 = time.perf_counter()
    new = reshard(checkpoints, checkpoint, nodes, rows_per_file=ssd_options.get("rows_per_file"))
    return new, {
        "checkpoint": str(new.path),
        "batch": new.batch,
        "from_nodes": old,
        "to_nodes": nodes,
        "seconds": time.perf_counter() - t0,
    }


def lost_nodes(nodes: list[NodeActors], dead: list[str], alive: dict) -> dict[int, str]:
    """The job's nodes that are lost, by index, with why: the Ray node is gone, or every stage
    actor of the node is dead."""
    lost = {}
    for node in nodes:
        names = [f"{k}[node {node.index}]" for k, a in zip(("SSDPS", "MemPS", "Trainer", "Reader"), _handles(node))]
        if node.node_id not in alive:
            lost[node.index] = f"Ray node {node.node_id} is gone"
        elif names and all(name in dead for name in names):
            lost[node.index] = f"every actor of node {node.index} (Ray node {node.node_id}) died"
    return lost


def _handles(node: NodeActors) -> list:
    return [a for a in (node.ssd, node.mem, node.trainer, node.reader) if a is not None]


def shrink(pipeline: Any, checkpoint: Checkpoint, lost: dict[int, str]) -> dict:
    """Continue on the nodes that are left: stop every actor, re-partition ``checkpoint`` onto
    the survivors (committed in its place) and start the stages there from it. The lost nodes'
    Ray nodes are not used again by this pipeline. Returns the recovery's record."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    nodes: list[NodeActors] = pipeline._nodes
    survivors = [nd for nd in nodes if nd.index not in lost]
    stop_actors([a for nd in nodes for a in _handles(nd)] + list(pipeline._aggregators or []))
    pipeline._aggregators = None
    release_placements(f"{pipeline.name}:")
    pipeline._lost_nodes |= {nodes[i].node_id for i in lost}
    n = len(survivors)
    new, reshaped = reshape(pipeline._checkpoints, checkpoint, n, pipeline.ssd_settings.options)
    alive = {node["NodeID"]: node for node in training_nodes()}
    fetch_shards(pipeline._checkpoints, new, [(i, nd.node_id) for i, nd in enumerate(survivors) if nd.node_id in alive])
    root = os.path.dirname(nodes[0].ssd_dir)
    placed = []
    for i, nd in enumerate(survivors):
        if nd.node_id not in alive:
            raise NoSpareNode(f"node {nd.index} of the job (Ray node {nd.node_id}) is gone too; no node is left")
        placed.append(
            place_node(pipeline, i, alive[nd.node_id], n, f"{root}/node-{i}", snapshot_of(new, i), admission_of(new, i))
        )
    pipeline._nodes, pipeline.n_nodes = placed, n
    devices = pipeline.trainer_settings.n_devices
    if needs_group(n, devices):
        pipeline._generation += 1
        pipeline._aggregators = join_group(pipeline.name, placed, pipeline.sync, pipeline._generation, devices)
    load_trainers(new, placed)
    return {
        "restarted": sorted(f"{k}[node {nd.index}]" for nd in placed for k in ("SSDPS", "MemPS", "Trainer")),
        "reset": [],
        "lost_nodes": [
            {"node": i, "ray_node": nodes[i].node_id, "why": why, "at": at} for i, why in sorted(lost.items())
        ],
        "nodes": n,
        "ray_nodes": [nd.node_id for nd in placed],
        "reshaped": reshaped,
    }


def restart_from(pipeline: Any, checkpoint: Checkpoint, dead: list[str], timeout: float = 60.0) -> dict:
    """Bring ``pipeline``'s actors to ``checkpoint``'s state after the ``dead`` ones died.

    A lost node (its Ray node gone, or every actor of it dead: :func:`lost_nodes`) moves to a
    spare node; with none, the job shrinks onto the nodes left (:func:`shrink`; with none left,
    a node whose Ray node is alive starts again in place, one that is gone raises
    :class:`NoSpareNode`). Dead actors start again;
    the others are reset in place, which costs no process start: MEM-PS drops its cache unwritten
    first, then SSD-PS is restored from the checkpoint's snapshot (so no stale row reaches it),
    and trainers reload their state. A MEM-PS whose SSD-PS restarted restarts with it. With
    several nodes, a dead trainer restarts every trainer (the others may wait in a collective
    for it) and the group is formed anew; so does SSP/ASP (the clock board starts over). A
    survivor that does not answer within ``timeout`` is restarted too. Returns what was
    ``restarted`` and ``reset``, by actor name.
    """
    nodes: list[NodeActors] = pipeline._nodes
    n = len(nodes)
    kinds = ("SSDPS", "MemPS", "Trainer", "Reader")
    restart = {(kind, node.index) for node in nodes for kind in kinds if f"{kind}[node {node.index}]" in dead}
    alive = {node["NodeID"]: node for node in training_nodes()}
    used = {nd.node_id for nd in nodes} | pipeline._lost_nodes
    spare = [node_id for node_id in alive if node_id not in used]
    lost = lost_nodes(nodes, dead, alive)
    for i in list(lost):
        if spare:
            pipeline._lost_nodes.add(nodes[i].node_id)
            nodes[i].node_id = spare.pop(0)
            restart |= {(kind, i) for kind in kinds}
            del lost[i]
    if lost and len(lost) < n:
        return shrink(pipeline, checkpoint, lost)
    for node in nodes:
        if node.node_id not in alive:
            raise NoSpareNode(
                f"node {node.index} of the job (Ray node {node.node_id}) is gone and the cluster has no other "
                "alive node to take its place; add a node (ray start --address=...) and resume"
            )
    sync = pipeline.sync
    trainers_together = n > 1 and (
        any(kind == "Trainer" for kind, _ in restart) or sync.consistency != "bsp" or sync.dense != "allreduce"
    )
    if trainers_together:
        restart |= {("Trainer", node.index) for node in nodes}
    restart |= {("MemPS", i) for kind, i in list(restart) if kind == "SSDPS"}

    fetch_shards(pipeline._checkpoints, checkpoint, [(nd.index, nd.node_id) for nd in nodes])

    def handle(kind: str, node: NodeActors) -> Any:
        return {"SSDPS": node.ssd, "MemPS": node.mem, "Trainer": node.trainer, "Reader": node.reader}[kind]

    def reset_or_restart(kind: str, calls: dict) -> None:
        """Wait for the survivors' reset calls; a failed or silent one joins the restarts."""
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout) if calls else ([], [])
        for i, ref in calls.items():
            try:
                if ref not in ready:
                    raise TimeoutError
                ray.get(ref)
            except Exception:  # noqa: BLE001 - it goes the way of the dead
                restart.add((kind, i))
                stop_actors([handle(kind, nodes[i])])

    stop_actors([handle(kind, nodes[i]) for kind, i in restart if handle(kind, nodes[i]) is not None])
    if trainers_together:
        stop_actors(pipeline._aggregators or [])
        pipeline._aggregators = None
    reset_or_restart(
        "MemPS",
        {
            nd.index: nd.mem.reset.remote(admission_of(checkpoint, nd.index))
            for nd in nodes
            if ("MemPS", nd.index) not in restart
        },
    )
    ssd_calls = {
        nd.index: nd.ssd.restore.remote(snapshot_of(checkpoint, nd.index))
        for nd in nodes
        if ("SSDPS", nd.index) not in restart
    }
    reset_or_restart("SSDPS", ssd_calls)
    restart |= {("MemPS", i) for kind, i in list(restart) if kind == "SSDPS"}
    started = set()
    for node in nodes:
        if ("SSDPS", node.index) in restart:
            node.ssd = start_ssd(pipeline, node.index, node.node_id, node.ssd_dir, snapshot_of(checkpoint, node.index))
        if ("MemPS", node.index) in restart:
            stop_actors([node.mem])
            node.mem = start_mem(pipeline, node.index, node.node_id, node.ssd, admission_of(checkpoint, node.index))
        if ("Trainer", node.index) in restart:
            node.trainer = start_trainer(pipeline, node.index, alive[node.node_id], n)
            started.add(node.index)
        if ("Reader", node.index) in restart:
            node.reader = None  # the pass opens a new one
    reset_or_restart(
        "Trainer",
        {
            nd.index: nd.trainer.reset.remote(trainer_state_of(checkpoint, nd.index))
            for nd in nodes
            if ("Trainer", nd.index) not in restart
        },
    )
    for node in nodes:  # survivors that failed their reset
        if ("Trainer", node.index) in restart and node.index not in started:
            node.trainer = start_trainer(pipeline, node.index, alive[node.node_id], n)
            started.add(node.index)
    if started:
        load_trainers(checkpoint, [nd for nd in nodes if nd.index in started])
    devices = pipeline.trainer_settings.n_devices
    if needs_group(n, devices) and (trainers_together or started):
        pipeline._generation += 1
        pipeline._aggregators = join_group(pipeline.name, nodes, sync, pipeline._generation, devices)
    return {
        "restarted": sorted(f"{kind}[node {i}]" for kind, i in restart),
        "reset": sorted(
            f"{kind}[node {nd.index}]" for nd in nodes for kind in kinds[:3] if (kind, nd.index) not in restart
        ),
    }


def actor_lost(error: BaseException) -> bool:
    """Whether ``error`` says an actor, its node or an object it owned is gone."""
    return caused_by(error, ACTOR_LOST)  # type: ignore[arg-type]


def dead_actors(actors: dict, timeout: float = 3.0) -> list[str]:
    """Names of the ``{name: handle}`` actors that are dead (a call to them fails as lost).
    An actor busy past ``timeout`` (e.g. waiting in a collective for a dead peer) counts as alive."""
    probes = {name: a.__ray_ready__.remote() for name, a in actors.items()}
    ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=timeout)
    finished = set(ready)
    dead = []
    for name, ref in probes.items():
        if ref in finished:
            try:
                ray.get(ref)
            except ACTOR_LOST:
                dead.append(name)
    return dead


def stop_actors(actors: list, timeout: float = 30.0) -> None:
    """Kill ``actors`` and wait until Ray has them dead (their names are free again)."""
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001,S112 - already gone
            continue
    probes = []
    for a in actors:
        try:
            probes.append(a.__ray_ready__.remote())
        except Exception:  # noqa: BLE001,S112 - already gone
            continue
    deadline = time.monotonic() + timeout
    for ref in probes:
        try:
            ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
        except Exception:  # noqa: BLE001,S112 - dead, as asked
            continue


def recovery_entry(
    root: BaseException, dead: list, failed_at: int, resumed_from: int, seconds: float, done: dict
) -> dict:
    """The run report's record of one recovery: the error (its first line), the dead actors, the
    batch it failed at and the one it resumed from, the batches replayed, the restart's seconds
    and what :func:`restart_from` returned."""
    return {
        "error": f"{type(root).__name__}: {root}".splitlines()[0][:300],
        "dead": dead,
        "failed_at_batch": failed_at,
        "resumed_from_batch": resumed_from,
        "replayed_batches": max(failed_at - resumed_from, 0),
        "restart_s": seconds,
        **done,
    }
