"""The pipeline: read → pull → load → train over Ray actors (DESIGN §2, paper Algorithm 1).

Ordering on the MEM-PS actor is what keeps training BSP-exact (DESIGN invariant 2). The
driver submits, per batch ``t``::

    train(t) ; pull(t+1) ; write_back(t)

so MEM-PS runs ``pull(t+1)`` while batch ``t`` trains, and ``pull(t+2)`` only after
``write_back(t)`` (a Ray actor runs one caller's calls in submission order). The rows that
``pull(t+1)`` served early for keys also in batch ``t`` are stale, and the trainer ignores them:
it keeps those rows resident in HBM-PS from batch ``t`` (see :mod:`hpsray.tiers.hbm`). The reader
runs up to ``read_queue`` batches ahead through a :class:`BoundedEdge`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import ray

from hpsray.actors.memps import MemPSShard
from hpsray.actors.reader import Reader
from hpsray.actors.ssdps import SSDPSShard
from hpsray.actors.trainer import Trainer
from hpsray.cluster.runtime import alive_nodes, connect, on_node
from hpsray.data.batch import Batch
from hpsray.models.metrics import auc, logloss
from hpsray.pipelines.edge import BoundedEdge
from hpsray.pipelines.stages import MemPSStage, SSDPSStage, TrainerStage


class TrainingStopped(RuntimeError):
    """A stage failed during ``fit()``; what trained before it was kept (DESIGN invariant 7).

    ``cause`` is the failure as raised (e.g. a ``RayTaskError`` wrapping a ``DataError``);
    ``saved_batches`` counts the batches whose rows were written back and flushed to SSD-PS.
    """

    def __init__(self, cause: BaseException, saved_batches: int) -> None:
        self.cause = cause
        self.saved_batches = saved_batches
        root = cause
        while getattr(root, "cause", None) is not None and root.cause is not root:
            root = root.cause
        super().__init__(f"{type(root).__name__}: {root}\n(the rows of the {saved_batches} batches trained "
                         f"before the failure were written back and flushed to SSD-PS)")


@dataclass
class _Node:
    index: int
    node_id: str
    ssd: object
    mem: object
    trainer: object
    readers: list = field(default_factory=list)


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
    """

    def __init__(self, source, trainer: TrainerStage | None = None, mem: MemPSStage | None = None,
                 ssd: SSDPSStage | None = None, transforms: Sequence[Callable[[Batch], Batch]] = (),
                 batch_size: int = 65536, read_queue: int = 2, address: str | None = None,
                 name: str | None = None) -> None:
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
        node = alive_nodes()[0]
        node_id = node["NodeID"]
        width = self.config.row_width
        ssd_path = self.ssd_stage.path
        if ssd_path is None:
            self._tmp = ssd_path = tempfile.mkdtemp(prefix="hpsray-ssd-")
        strategy = on_node(node_id)
        opts = dict(num_cpus=0, scheduling_strategy=strategy, max_concurrency=1)
        i = 0
        ssd = ray.remote(SSDPSShard).options(name=f"{self.name}:SSDPS[node {i}]", **opts).remote(
            i, f"{ssd_path}/node-{i}", width, **self.ssd_stage.options)
        mem = ray.remote(MemPSShard).options(name=f"{self.name}:MemPS[node {i}]", **opts).remote(
            i, ssd, width, self.config.row_init(), self.mem_stage.capacity_rows, self.mem_stage.capacity_bytes,
            **self.mem_stage.options)
        t = self.trainer_stage
        capacity = t.hbm_capacity or 2 * self.batch_size * max(self.source.n_slots, 1)
        trainer = ray.remote(Trainer).options(name=f"{self.name}:Trainer[node {i}]", **opts).remote(
            i, 1, self.config, self.source.n_slots, self.source.n_dense, capacity, t.n_devices, t.device,
            t.model, t.threads)
        self._nodes = [_Node(i, node_id, ssd, mem, trainer)]

    def _reader(self, node: _Node, source, name: str):
        opts = dict(num_cpus=0, scheduling_strategy=on_node(node.node_id))
        return ray.remote(Reader).options(name=f"{self.name}:{name}[node {node.index}]", **opts).remote(
            source, self.batch_size, node.index, 0, 1, self.transforms)

    # -- training ------------------------------------------------------------------------

    def fit(self, progress: bool = True) -> dict:
        """Train one pass over the source; returns the run report (also ``self.report``)."""
        self._start()
        node = self._nodes[0]
        passes = len(node.readers)
        reader = self._reader(node, self.source, "Reader" if passes == 0 else f"Reader#{passes + 1}")
        node.readers.append(reader)
        reads = BoundedEdge("read→pull", self.read_queue)
        pending_reads: list = []
        t0 = time.perf_counter()

        first = self._next_batch

        def next_read(t):
            batch_ref, keys_ref, n_ref = reader.read.remote(first + t)
            reads.put(n_ref)
            pending_reads.append((batch_ref, keys_ref, n_ref))

        next_read(0)
        for k in range(1, self.read_queue):
            next_read(k)
        write_backs = BoundedEdge("train→write-back", 2)
        batch_ref, keys_ref, n_ref = pending_reads.pop(0)
        t, examples = 0, 0
        in_training = None  # (batch id, result ref) of a batch whose write-back is not yet submitted
        try:
            if ray.get(n_ref) == 0:
                raise ValueError("the source produced no examples")
            pull_ref = node.mem.pull.remote(first, keys_ref)
            while True:
                result_ref = node.trainer.train.remote(first + t, batch_ref, keys_ref, pull_ref)
                in_training = (first + t, result_ref)
                next_read(t + self.read_queue)
                nb_ref, nk_ref, nn_ref = pending_reads.pop(0)
                more = ray.get(nn_ref) > 0  # raises the reader's error (bad input in strict mode)
                if more:
                    next_pull = node.mem.pull.remote(first + t + 1, nk_ref)
                write_backs.put(node.mem.write_back.remote(first + t, result_ref))
                in_training = None
                examples += ray.get(n_ref)
                if progress:
                    self._progress(t, examples, t0)
                if not more:
                    break
                t += 1
                batch_ref, keys_ref, n_ref, pull_ref = nb_ref, nk_ref, nn_ref, next_pull
            write_backs.drain()
        except Exception as e:
            raise TrainingStopped(e, self._salvage(node, write_backs, in_training)) from e
        wall = time.perf_counter() - t0
        if progress:
            print(file=sys.stderr)
        self._next_batch = first + t + 1
        self.report = self._report(wall, range(first, first + t + 1), examples, reads, write_backs)
        return self.report

    def _salvage(self, node: _Node, write_backs: BoundedEdge, in_training) -> int:
        """After a failure: finish the write-backs of every batch that trained, flush MEM-PS to
        SSD-PS, and return how many batches were saved (DESIGN invariant 7)."""
        refs = write_backs.in_flight()
        if in_training is not None:
            refs.append(node.mem.write_back.remote(*in_training))
        saved = 0
        for ref in refs:
            try:
                ray.get(ref)
                saved += 1
            except Exception:  # that batch failed itself; its rows were never trained
                pass
        ray.get(node.mem.flush.remote())
        return saved

    def _progress(self, t: int, examples: int, t0: float) -> None:
        rate = examples / max(time.perf_counter() - t0, 1e-9)
        print(f"\r[hpsray] batch {t + 1}: {examples:,} examples submitted, {rate:,.0f} examples/s",
              end="", file=sys.stderr, flush=True)

    def _report(self, wall: float, batches: range, examples: int, *edges: BoundedEdge) -> dict:
        """The run report of one ``fit()``: only the batches it trained count."""
        node = self._nodes[0]
        stats = ray.get([node.readers[-1].stats.remote(), node.mem.stats.remote(), node.ssd.stats.remote(),
                         node.trainer.stats.remote()])
        reader, mem, ssd, trainer = stats
        stages = {s["stage"]: s for s in (reader, mem, ssd, trainer)}
        mine = set(batches)
        per_batch = {name: {b: v for b, v in s["per_batch"].items() if b in mine} for name, s in stages.items()}
        busy = {name: float(sum(v.values())) for name, v in per_batch.items()}
        store = ssd["store"]
        bad = ray.get(node.readers[-1].bad_input.remote())
        return {
            "mode": "bsp",
            "nodes": 1,
            "devices_per_node": self.trainer_stage.n_devices,
            "batches": len(batches),
            "examples": examples,
            "wall_s": wall,
            "examples_per_s": examples / wall if wall > 0 else 0.0,
            "stage_busy_s": busy,
            "pipeline_efficiency": max(busy.values()) / wall if wall > 0 else 0.0,
            "per_batch_s": {name: {str(k): v for k, v in sorted(pb.items())} for name, pb in per_batch.items()},
            "cache_hit_rate": {str(k): v for k, v in sorted(mem["hit_rate"].items()) if k in mine},
            "ssd": {k: store[k] for k in ("bytes_read", "bytes_written", "files", "disk_bytes", "live_bytes",
                                          "space_ratio", "compactions", "load_seconds", "dump_seconds")},
            "cache": mem["cache"],
            "loss": {str(k): v for k, v in sorted(trainer["losses"].items()) if k in mine},
            "queues": {e.name: {"capacity": e.capacity, "max_depth": e.max_depth, "stalls": e.stalls} for e in edges},
            "bad_input": bad,
        }

    # -- using the trained model ---------------------------------------------------------

    def evaluate(self, source) -> dict:
        """AUC and log-loss of the trained model over ``source``'s examples."""
        self._start()
        node = self._nodes[0]
        reader = self._reader(node, source, "EvalReader")
        labels, probs = [], []
        t = 0
        while True:
            batch_ref, keys_ref, n_ref = reader.read.remote(t)
            if ray.get(n_ref) == 0:
                break
            rows_ref = node.mem.lookup.remote(keys_ref)
            probs.append(ray.get(node.trainer.predict.remote(batch_ref, keys_ref, rows_ref)))
            labels.append(ray.get(batch_ref).labels)
            t += 1
        ray.kill(reader)
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
            out.update({f"SSDPS[node {n.index}]": n.ssd, f"MemPS[node {n.index}]": n.mem,
                        f"Trainer[node {n.index}]": n.trainer})
            for i, r in enumerate(n.readers):
                out[f"Reader[node {n.index}]#{i}"] = r
        return out

    def shutdown(self) -> None:
        """Stop the actors (closing the SSD-PS stores) and remove a temporary SSD directory."""
        for n in self._nodes:
            try:
                ray.get(n.ssd.close.remote())
            except Exception:
                pass
            for a in [n.mem, n.trainer, n.ssd, *n.readers]:
                ray.kill(a)
        self._nodes = []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
