"""``Pipeline``: the user's handle on a training job over Ray actors (docs/architecture.md: The
pipeline).

It places one reader, MEM-PS, SSD-PS and trainer per node (:mod:`~hpsray.pipelines.placement`),
drives the batches (:mod:`~hpsray.pipelines.schedule`), reports (:mod:`~hpsray.pipelines.summary`)
and serves the trained model back (evaluate, export).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import ray

from hpsray.cluster.runtime import connect, training_nodes
from hpsray.data.batch import Batch
from hpsray.errors import TrainingStopped
from hpsray.models.metrics import auc, logloss
from hpsray.pipelines.placement import NodeActors, join_group, open_reader, place_node
from hpsray.pipelines.progress import known_examples, progress_bar
from hpsray.pipelines.schedule import PassSchedule
from hpsray.pipelines.stages import MemPSStage, SSDPSStage, SyncStage, TrainerStage
from hpsray.pipelines.summary import run_report


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
        self._nodes: list[NodeActors] = []
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
        ssd_path = self.ssd_stage.path
        if ssd_path is None:
            self._tmp = ssd_path = tempfile.mkdtemp(prefix="hpsray-ssd-")
        t = self.trainer_stage
        capacity = t.hbm_capacity or 2 * self.batch_size * max(self.source.n_slots, 1)
        for i, node in enumerate(alive[:n_nodes]):
            self._nodes.append(place_node(self, i, node, n_nodes, f"{ssd_path}/node-{i}", capacity))
        if n_nodes > 1:
            self._aggregators = join_group(self.name, self._nodes, self.sync)

    def _open_reader(self, node: NodeActors, source, index: int, count: int):
        return open_reader(self, node, source, index, count, len(self._nodes))

    # -- training ------------------------------------------------------------------------

    def fit(self, progress: bool = True) -> dict:
        """Train one pass over the source; returns the run report (also ``self.report``).

        Each node's reader reads that node's share of the source; the batches run on the
        schedule of :class:`~hpsray.pipelines.schedule.PassSchedule`. A failure stops training
        with :class:`TrainingStopped` after every batch that trained is written back.
        """
        self._start()
        nodes = self._nodes
        for node in nodes:
            self._open_reader(node, self.source, node.index, len(nodes))
        first = self._next_batch
        # the actors' processes start (seconds, on the first pass) before the clock does
        t_start = time.perf_counter()
        ray.get([a.__ray_ready__.remote() for node in nodes for a in node.stage_actors()])
        t0 = time.perf_counter()
        schedule = PassSchedule(nodes, first, self.read_queue)
        bar = progress_bar(known_examples(self.source), progress)
        try:
            schedule.run(bar)
        except Exception as e:
            saved = schedule.salvage()
            raise TrainingStopped(schedule.first_failure(e), saved) from e
        finally:
            bar.close()
        wall = time.perf_counter() - t0
        trained = range(first, first + schedule.batches)
        self._next_batch = first + schedule.batches
        self.report = run_report(
            nodes, self.sync, self.trainer_stage.n_devices, wall, trained, schedule.examples, schedule.edges
        )
        self.report["startup_s"] = t0 - t_start
        return self.report

    # -- using the trained model ---------------------------------------------------------

    def evaluate(self, source) -> dict:
        """AUC and log-loss of the trained model over ``source``'s examples (read on node 0,
        each key's row looked up at its owner)."""
        self._start()
        nodes = self._nodes
        reader = self._open_reader(nodes[0], source, 0, 1)
        labels, probs = [], []
        while True:
            read = ray.get(reader.read.remote(None))  # no batch id: not a training batch
            if read.examples == 0:
                break
            rows = [node.mem.lookup.remote(k) for node, k in zip(nodes, read.keys_by_owner)]
            probs.append(ray.get(nodes[0].trainer.predict.remote(read.batch, read.keys_by_owner, rows)))
            labels.append(ray.get(read.batch).labels)
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
