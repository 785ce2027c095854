"""The pipeline: read → pull → load → train over Ray actors (docs/architecture.md: The pipeline; paper Algorithm 1).

Ordering on the MEM-PS actor is what keeps training BSP-exact (docs/architecture.md: invariant 2). The
driver submits, per batch ``t``::

    train(t) ; pull(t+1) ; write_back(t)

so MEM-PS runs ``pull(t+1)`` while batch ``t`` trains, and ``pull(t+2)`` only after
``write_back(t)`` (a Ray actor runs one caller's calls in submission order). The rows that
``pull(t+1)`` served early for keys also in batch ``t`` are stale, and the trainer ignores them:
it keeps those rows resident in HBM-PS from batch ``t`` (see :mod:`hpsray.tiers.hbm`). The reader
runs up to ``read_queue`` batches ahead through a :class:`BoundedEdge`.

With several nodes the same order holds on every owner's MEM-PS, per borrower; rows that other
nodes changed in batch ``t`` are re-read for ``t+1`` after ``write_back(t)`` (``refresh``), and
every borrower returns its rows to their owners (docs/architecture.md, "One batch across nodes").
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import ray

from hpsray.actors.memps import MemPSShard
from hpsray.actors.reader import Reader
from hpsray.actors.ssdps import SSDPSShard
from hpsray.actors.trainer import Trainer
from hpsray.cluster.runtime import connect, on_node, training_nodes
from hpsray.data.batch import Batch
from hpsray.errors import ConfigError, PeerFailedError, TrainingStopped, caused_by
from hpsray.models.metrics import auc, logloss
from hpsray.pipelines.edge import BoundedEdge
from hpsray.pipelines.progress import known_examples, progress_bar
from hpsray.pipelines.stages import MemPSStage, SSDPSStage, SyncStage, TrainerStage


@dataclass
class _Node:
    index: int
    node_id: str
    ssd: object
    mem: object
    trainer: object
    reader: object = None  # created by the first pass, then reopened for each later one


def _sum_counts(caches: list[dict]) -> dict:
    """MEM-PS counters summed over nodes, the hit rate recomputed from the sums."""
    if len(caches) == 1:
        return caches[0]
    out = {k: sum(c[k] for c in caches) for k, v in caches[0].items() if isinstance(v, (int, float))}
    looked_up = out.get("hits", 0) + out.get("misses", 0)
    out["hit_rate"] = out.get("hits", 0) / looked_up if looked_up else 0.0
    return out


class Pipeline:
    """A training pipeline composed from stage objects; ``fit()`` trains, ``evaluate()`` scores.

    Args:
        source: a :class:`SyntheticSource`, :class:`FileSource`, or any object with
            ``open(batch_size, reader_index, num_readers) -> Iterator[Batch]``, ``n_slots``
            and ``n_dense``.
        trainer, mem, ssd: the stages.
        transforms: functions ``Batch -> Batch`` run in the reader (feature engineering).
        batch_size: examples per batch (the unit of pull/load/write-back).
        read_queue: batches the reader may run ahead of the pull stage.
        address: Ray address; an embedded local Ray when None (and no ``RAY_ADDRESS``).
        name: prefix of the actor names shown on the Ray dashboard.
        nodes: Ray nodes to train on, one MEM-PS, SSD-PS, trainer and reader each (``None``:
            every alive node).
        sync: how the nodes' trainers stay consistent (BSP, SSP, ASP) and combine dense
            gradients (all-reduce or PHub-style chunks).
    """

    def __init__(
        self,
        source,
        trainer: TrainerStage | None = None,
        mem: MemPSStage | None = None,
        ssd: SSDPSStage | None = None,
        transforms: Sequence[Callable[[Batch], Batch]] = (),
        batch_size: int = 65536,
        read_queue: int = 2,
        address: str | None = None,
        name: str | None = None,
        nodes: int | None = 1,
        sync: SyncStage | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if read_queue < 1:
            raise ValueError(f"read_queue must be >= 1, got {read_queue}")
        self.source = source
        self.trainer_stage = trainer or TrainerStage()
        self.mem_stage = mem or MemPSStage(capacity_rows=4 * batch_size * max(source.n_slots, 1))
        self.ssd_stage = ssd or SSDPSStage()
        self.transforms = list(transforms)
        self.batch_size = batch_size
        self.read_queue = read_queue
        self.address = address
        self.name = name or f"hpsray-{uuid.uuid4().hex[:6]}"
        if nodes is not None and nodes < 1:
            raise ValueError(f"nodes must be >= 1 (or None for every alive node), got {nodes}")
        self.n_nodes = nodes
        self.sync = sync or SyncStage()
        self._aggregators = None
        self.config = self.trainer_stage.config
        self._nodes: list[_Node] = []
        self._tmp: str | None = None
        self._started_ray = False
        self._next_batch = 0  # batch ids continue across fit() calls
        self.report: dict = {}

    # -- actors --------------------------------------------------------------------------

    def _start(self) -> None:
        if self._nodes:
            return
        self._started_ray = connect(self.address)
        alive = training_nodes()
        n_nodes = self.n_nodes or len(alive)
        if n_nodes > len(alive):
            raise ValueError(
                f"the pipeline asks for {n_nodes} nodes but the Ray cluster has {len(alive)} alive; "
                "start more nodes (ray start --address=...) or lower cluster.nodes"
            )
        width = self.config.row_width
        ssd_path = self.ssd_stage.path
        if ssd_path is None:
            self._tmp = ssd_path = tempfile.mkdtemp(prefix="hpsray-ssd-")
        t = self.trainer_stage
        capacity = t.hbm_capacity or 2 * self.batch_size * max(self.source.n_slots, 1)
        for i, node in enumerate(alive[:n_nodes]):
            opts = dict(num_cpus=0, scheduling_strategy=on_node(node["NodeID"]), max_concurrency=1)
            threads = t.threads or max(1, int(node.get("Resources", {}).get("CPU", 0)) or (os.cpu_count() or 1))
            ssd = (
                ray.remote(SSDPSShard)
                .options(name=f"{self.name}:SSDPS[node {i}]", **opts)
                .remote(i, f"{ssd_path}/node-{i}", width, **self.ssd_stage.options)
            )
            mem = (
                ray.remote(MemPSShard)
                .options(name=f"{self.name}:MemPS[node {i}]", **opts)
                .remote(
                    i,
                    ssd,
                    width,
                    self.config.row_init(),
                    self.mem_stage.capacity_rows,
                    self.mem_stage.capacity_bytes,
                    **self.mem_stage.options,
                )
            )
            trainer = (
                ray.remote(Trainer)
                .options(name=f"{self.name}:Trainer[node {i}]", **_trainer_resources(opts, t.device, node))
                .remote(
                    i,
                    n_nodes,
                    self.config,
                    self.source.n_slots,
                    self.source.n_dense,
                    capacity,
                    t.n_devices,
                    t.device,
                    t.model,
                    threads,
                )
            )
            self._nodes.append(_Node(i, node["NodeID"], ssd, mem, trainer))
        if n_nodes > 1:
            self._join_group()

    def _join_group(self) -> None:
        """Form the trainers' collective group (and the chunk aggregators, if chosen)."""
        sync = self.sync
        aggregators = None
        if sync.dense == "chunked":
            from hpsray.cluster.aggregation import start_aggregators

            aggregators = start_aggregators(
                len(self._nodes), node_ids=[n.node_id for n in self._nodes], name_prefix=self.name
            )
            self._aggregators = list(aggregators)
        board = None
        if sync.consistency != "bsp":
            from hpsray.cluster.consistency import ClockBoard

            board = (
                ray.remote(ClockBoard)
                .options(
                    name=f"{self.name}:ClockBoard",
                    num_cpus=0,
                    scheduling_strategy=on_node(self._nodes[0].node_id),
                    max_concurrency=1000,
                )
                .remote(len(self._nodes))
            )
            self._aggregators = [*(self._aggregators or []), board]
        group = f"{self.name}:trainers"
        ray.get([n.trainer.join.remote(len(self._nodes), group, sync, aggregators, board) for n in self._nodes])

    def _open_reader(self, node: _Node, source, index: int, count: int):
        """Node ``node``'s reader, reading share ``index`` of ``count`` of ``source`` from now on."""
        if node.reader is None:
            opts = dict(num_cpus=0, scheduling_strategy=on_node(node.node_id))
            node.reader = (
                ray.remote(Reader)
                .options(name=f"{self.name}:Reader[node {node.index}]", **opts)
                .remote(source, self.batch_size, node.index, index, count, self.transforms, len(self._nodes))
            )
        else:  # actor tasks from this driver run in order: the pass's reads come after this
            node.reader.open.remote(source, self.batch_size, index, count)
        return node.reader

    # -- training ------------------------------------------------------------------------

    def fit(self, progress: bool = True) -> dict:
        """Train one pass over the source; returns the run report (also ``self.report``).

        Each node's reader reads that node's share of the source. Per batch ``t`` the driver
        submits, on every node: ``train(t)``, the reads ahead, the pulls of ``t+1`` (each node's
        keys split by owner, every owner lending in parallel), the write-backs of ``t`` (each
        owner takes its rows back from every borrower) and, with several nodes, the refresh of
        rows of ``t+1`` that ``t`` changed elsewhere (see :meth:`MemPSShard.refresh`).
        """
        self._start()
        nodes = self._nodes
        n = len(nodes)
        for node in nodes:
            self._open_reader(node, self.source, node.index, n)
        reads = [BoundedEdge(f"read→pull[node {i}]" if n > 1 else "read→pull", self.read_queue) for i in range(n)]
        write_backs = [BoundedEdge(f"train→write-back[node {i}]" if n > 1 else "train→write-back", 2) for i in range(n)]
        pending: list = []  # per batch read ahead: per node (batch ref, key refs by owner, examples ref)
        first = self._next_batch
        # the actors' processes start (seconds, on the first pass) before the clock does
        t_start = time.perf_counter()
        ray.get([a.__ray_ready__.remote() for node in nodes for a in (node.ssd, node.mem, node.trainer, node.reader)])
        t0 = time.perf_counter()
        startup = t0 - t_start

        def read(t: int) -> None:
            row = []
            for node, edge in zip(nodes, reads):
                refs = node.reader.read.options(num_returns=n + 2).remote(first + t)
                edge.put(refs[-1])
                row.append((refs[0], refs[1:-1], refs[-1]))
            pending.append(row)

        def lend(t: int, row) -> list:  # [borrower][owner] -> rows ref
            return [[nodes[o].mem.pull.remote(first + t, row[b][1][o], b) for o in range(n)] for b in range(n)]

        def refresh(t: int) -> list:
            return [[nodes[o].mem.refresh.remote(first + t, b) for o in range(n)] for b in range(n)]

        for k in range(self.read_queue):
            read(k)
        t, examples = 0, 0
        bar = progress_bar(known_examples(self.source), progress)
        outcomes: list = []  # every trainer's {"loss", "examples"} ref, to find a failure's root
        in_training = None  # (batch id, result refs) of a batch whose write-backs are not yet submitted
        try:
            row = pending.pop(0)
            sizes = ray.get([r[2] for r in row])  # raises a reader's error (bad input in strict mode)
            if sum(sizes) == 0:
                raise ValueError("the source produced no examples")
            lent, fresh = lend(0, row), None
            while True:
                plan = {"sizes": sizes}
                results = [
                    node.trainer.train.options(num_returns=n + 1).remote(
                        first + t, [row[b][0], *row[b][1], *lent[b], *(fresh[b] if fresh else ())], plan
                    )
                    for b, node in enumerate(nodes)
                ]
                in_training = (first + t, results)
                outcomes += [r[-1] for r in results]
                read(t + self.read_queue)
                next_row = pending.pop(0)
                next_sizes = ray.get([r[2] for r in next_row])
                more = sum(next_sizes) > 0
                if more:
                    next_lent = lend(t + 1, next_row)
                for o, node in enumerate(nodes):
                    write_backs[o].put(node.mem.write_back.remote(first + t, *[results[b][o] for b in range(n)]))
                in_training = None
                fresh = refresh(t + 1) if more and n > 1 else None
                examples += sum(sizes)
                bar.update(sum(sizes))
                if not more:
                    break
                t += 1
                row, sizes, lent = next_row, next_sizes, next_lent
            for edge in write_backs:
                edge.drain()
        except Exception as e:
            saved = self._salvage(write_backs, in_training)
            raise TrainingStopped(self._first_failure(e, outcomes), saved) from e
        finally:
            bar.close()
        wall = time.perf_counter() - t0
        self._next_batch = first + t + 1
        self.report = self._report(wall, range(first, first + t + 1), examples, *reads, *write_backs)
        self.report["startup_s"] = startup
        return self.report

    @staticmethod
    def _first_failure(error: BaseException, outcomes: list) -> BaseException:
        """The error that stopped training: when trainers of other nodes failed only because
        one of them did (see :meth:`Trainer.train`), that one's error."""
        if not caused_by(error, PeerFailedError):
            return error
        done, _ = ray.wait(outcomes, num_returns=len(outcomes), timeout=0)
        for ref in [r for r in outcomes if r in set(done)]:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - looking for the root cause
                if not caused_by(e, PeerFailedError):
                    return e
        return error

    def _salvage(self, write_backs: list[BoundedEdge], in_training) -> int:
        """After a failure: finish the write-backs of every batch that trained, flush MEM-PS to
        SSD-PS, and return how many batches were saved (docs/architecture.md: invariant 7)."""
        nodes = self._nodes
        refs = [ref for edge in write_backs for ref in edge.in_flight()]
        if in_training is not None:
            batch_id, results = in_training
            refs += [node.mem.write_back.remote(batch_id, *[r[o] for r in results]) for o, node in enumerate(nodes)]
        saved = 0
        for ref in refs:
            try:
                ray.get(ref)
                saved += 1
            except Exception:  # that batch failed itself; its rows were never trained
                pass
        ray.get([node.mem.flush.remote() for node in nodes])
        return saved // len(nodes)

    def _report(self, wall: float, batches: range, examples: int, *edges: BoundedEdge) -> dict:
        """The run report of one ``fit()``: only the batches it trained count.

        With several nodes, a stage's busy seconds (per batch and in all) are those of its
        busiest node, so ``pipeline_efficiency`` is the slowest (stage, node) over wall time;
        ``per_node`` keeps every node's own figures.
        """
        nodes = self._nodes
        stats = ray.get(
            [
                ref
                for node in nodes
                for ref in (
                    node.reader.stats.remote(),
                    node.mem.stats.remote(),
                    node.ssd.stats.remote(),
                    node.trainer.stats.remote(),
                    node.reader.bad_input.remote(),
                )
            ]
        )
        per_node = [stats[5 * i : 5 * i + 5] for i in range(len(nodes))]
        mine = set(batches)
        node_busy, node_per_batch = [], []
        for reader, mem, ssd, trainer, _ in per_node:
            stages = {s["stage"]: s for s in (reader, mem, ssd, trainer)}
            pb = {name: {b: v for b, v in s["per_batch"].items() if b in mine} for name, s in stages.items()}
            node_per_batch.append(pb)
            node_busy.append({name: float(sum(v.values())) for name, v in pb.items()})
        busy = {name: max(nb[name] for nb in node_busy) for name in node_busy[0]}
        per_batch = {
            name: {b: max(pb[name].get(b, 0.0) for pb in node_per_batch) for b in sorted(mine)}
            for name in node_per_batch[0]
        }
        hit_rate = {
            b: float(np.mean([mem["hit_rate"][b] for _, mem, _, _, _ in per_node if b in mem["hit_rate"]]))
            for b in sorted(mine)
            if any(b in mem["hit_rate"] for _, mem, _, _, _ in per_node)
        }
        ssd_keys = (
            "bytes_read",
            "bytes_written",
            "files",
            "disk_bytes",
            "live_bytes",
            "compactions",
            "load_seconds",
            "dump_seconds",
        )
        stores = [ssd["store"] for _, _, ssd, _, _ in per_node]
        ssd_total = {k: sum(st[k] for st in stores) for k in ssd_keys}
        ssd_total["space_ratio"] = ssd_total["disk_bytes"] / ssd_total["live_bytes"] if ssd_total["live_bytes"] else 0.0
        trainer0 = per_node[0][3]
        report = {
            "mode": self.sync.consistency if len(nodes) > 1 else "bsp",
            "nodes": len(nodes),
            "devices_per_node": self.trainer_stage.n_devices,
            "batches": len(batches),
            "examples": examples,
            "wall_s": wall,
            "examples_per_s": examples / wall if wall > 0 else 0.0,
            "stage_busy_s": busy,
            "pipeline_efficiency": max(busy.values()) / wall if wall > 0 else 0.0,
            "per_batch_s": {name: {str(k): v for k, v in pb.items()} for name, pb in per_batch.items()},
            "cache_hit_rate": {str(k): v for k, v in hit_rate.items()},
            "ssd": ssd_total,
            "cache": _sum_counts([mem["cache"] for _, mem, _, _, _ in per_node]),
            "loss": {str(k): v for k, v in sorted(trainer0["losses"].items()) if k in mine},
            "queues": {e.name: {"capacity": e.capacity, "max_depth": e.max_depth, "stalls": e.stalls} for e in edges},
            "bad_input": per_node[0][4] if len(nodes) == 1 else {f"node {i}": r[4] for i, r in enumerate(per_node)},
        }
        if len(nodes) > 1:
            trainers = [r[3] for r in per_node]
            report["sync"] = {
                "consistency": self.sync.consistency,
                "staleness_bound": self.sync.staleness if self.sync.consistency == "ssp" else None,
                "max_staleness_observed": max(tr.get("max_staleness", 0) for tr in trainers),
                "dense": self.sync.dense,
                "exchanged_bytes_per_minibatch": float(np.mean([tr["exchanged_bytes_per_step"] for tr in trainers])),
            }
            report["per_node"] = [
                {"node": i, "stage_busy_s": nb, "examples": r[0]["examples"], "cache": r[1]["cache"]}
                for i, (nb, r) in enumerate(zip(node_busy, per_node))
            ]
        return report

    # -- using the trained model ---------------------------------------------------------

    def evaluate(self, source) -> dict:
        """AUC and log-loss of the trained model over ``source``'s examples (read on node 0,
        each key's row looked up at its owner)."""
        self._start()
        nodes = self._nodes
        n = len(nodes)
        reader = self._open_reader(nodes[0], source, 0, 1)
        labels, probs = [], []
        while True:
            refs = reader.read.options(num_returns=n + 2).remote(None)  # no batch id: not a training batch
            if ray.get(refs[-1]) == 0:
                break
            key_refs = refs[1:-1]
            row_refs = [node.mem.lookup.remote(k) for node, k in zip(nodes, key_refs)]
            probs.append(ray.get(nodes[0].trainer.predict.remote(refs[0], *key_refs, *row_refs)))
            labels.append(ray.get(refs[0]).labels)
        if not labels:
            raise ValueError("the evaluation source produced no examples")
        y, p = np.concatenate(labels), np.concatenate(probs)
        return {"auc": auc(y, p), "logloss": logloss(y, p), "examples": int(y.size)}

    def export_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every trained row ``(keys sorted, rows)``: MEM-PS is flushed, then SSD-PS scanned."""
        self._start()
        keys, rows = [], []
        for node in self._nodes:
            ray.get(node.mem.flush.remote())
            for k, r in ray.get(node.ssd.scan.remote()):
                keys.append(k)
                rows.append(r)
        if not keys:
            return np.empty(0, np.uint64), np.empty((0, self.config.row_width), np.float32)
        k, r = np.concatenate(keys), np.concatenate(rows)
        order = np.argsort(k)
        return k[order], r[order]

    def dense_state(self) -> dict:
        """The trained dense model's ``state_dict``."""
        return ray.get(self._nodes[0].trainer.dense_state.remote())

    def actors(self) -> dict:
        """Actor handles by dashboard name."""
        out = {}
        for n in self._nodes:
            out.update(
                {
                    f"SSDPS[node {n.index}]": n.ssd,
                    f"MemPS[node {n.index}]": n.mem,
                    f"Trainer[node {n.index}]": n.trainer,
                }
            )
            if n.reader is not None:
                out[f"Reader[node {n.index}]"] = n.reader
        return out

    def shutdown(self) -> None:
        """Stop the actors (closing the SSD-PS stores) and remove a temporary SSD directory."""
        for n in self._nodes:
            try:
                ray.get(n.ssd.close.remote())
            except Exception:
                pass
            for a in [n.mem, n.trainer, n.ssd, *([n.reader] if n.reader is not None else [])]:
                ray.kill(a)
        for a in self._aggregators or []:
            ray.kill(a)
        self._nodes, self._aggregators = [], None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _trainer_resources(opts: dict, device: str, node: dict) -> dict:
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
