"""``Pipeline``: the user's handle on a training job over Ray actors (docs/architecture.md: The
pipeline).

It places one reader, MEM-PS, SSD-PS and trainer per node (:mod:`~hpsray.pipelines.placement`),
drives the batches (:mod:`~hpsray.pipelines.schedule`), reports (:mod:`~hpsray.pipelines.summary`)
and serves the trained model back (evaluate, export).
"""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from hpsray.checkpoint import Checkpoint, job_fingerprint
from hpsray.checkpoint.remote import open_checkpoints
from hpsray.cluster.runtime import connect, training_nodes
from hpsray.data.batch import Batch
from hpsray.errors import CheckpointError, CorruptFileError, TrainingStopped, caused_by
from hpsray.models.metrics import auc, logloss
from hpsray.pipelines.placement import NodeActors, join_group, needs_group, open_reader, place_node, release_placements
from hpsray.pipelines.progress import Progress, known_examples
from hpsray.pipelines.progress import progress_seconds as progress_seconds_of
from hpsray.pipelines.recovery import (
    CheckpointCosts,
    actor_lost,
    admission_of,
    dead_actors,
    load_trainers,
    reshape,
    restart_from,
    snapshot_of,
    write_checkpoint,
)
from hpsray.pipelines.schedule import PassSchedule
from hpsray.pipelines.settings import CheckpointSettings, MemPSSettings, SSDPSSettings, SyncSettings, TrainerSettings
from hpsray.pipelines.sources import PipelineSource
from hpsray.pipelines.summary import run_report
from hpsray.report import RunReport


class Pipeline:
    """A training pipeline composed from stage objects; ``fit()`` trains, ``evaluate()`` scores.

    Args:
        source: a :class:`SyntheticSource`, :class:`FileSource`, or any object with
            ``open(batch_size, reader_index, num_readers) -> Iterator[Batch]``, ``n_slots``
            and ``n_dense``.
        trainer, mem, ssd: the stages.
        transforms: functions ``Batch -> Batch`` run in the reader (feature engineering).
        batch_size: examples per batch (the unit of pull/load/write-back).
        read_queue: batches the reader may run ahead of the pull stage (the read→pull edge).
        pull_queue, load_queue, write_back_queue: the capacities of the pull→load, load→train
            and train→write-back edges (docs/architecture.md: The pipeline).
        address: Ray address; an embedded local Ray when None (and no ``RAY_ADDRESS``).
        name: prefix of the actor names shown on the Ray dashboard.
        nodes: Ray nodes to train on, one MEM-PS, SSD-PS, trainer and reader each (``None``:
            every alive node).
        sync: how the nodes' trainers stay consistent (BSP, SSP, ASP) and combine dense
            gradients (all-reduce or PHub-style chunks).
        checkpoint: where and how often to checkpoint, and how often to recover from a dead
            actor (``None``: no checkpoints; a dead actor stops ``fit()``).
        progress_seconds: seconds between progress lines when stderr is not a terminal
            (``None``: ``$HPSRAY_PROGRESS_SECONDS``, else 30; docs/operations.md: Progress).
        preflight: before the first ``fit()`` starts any actor, run ``hpsray train``'s checks
            (:func:`~hpsray.pipelines.preflight.preflight`: files and columns, an earlier run's
            SSD-PS files or checkpoints, the plan's capacity check); ``hpsray train`` runs them
            itself and passes ``False``.
    """

    def __init__(
        self,
        source: PipelineSource,
        trainer: TrainerSettings | None = None,
        mem: MemPSSettings | None = None,
        ssd: SSDPSSettings | None = None,
        transforms: Sequence[Callable[[Batch], Batch]] = (),
        batch_size: int = 65536,
        read_queue: int = 2,
        pull_queue: int = 2,
        load_queue: int = 2,
        write_back_queue: int = 2,
        address: str | None = None,
        name: str | None = None,
        nodes: int | None = 1,
        sync: SyncSettings | None = None,
        checkpoint: CheckpointSettings | None = None,
        progress_seconds: float | None = None,
        preflight: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for edge, capacity in (
            ("read_queue", read_queue),
            ("pull_queue", pull_queue),
            ("load_queue", load_queue),
            ("write_back_queue", write_back_queue),
        ):
            if capacity < 1:
                raise ValueError(f"{edge} must be >= 1, got {capacity}")
        self.source = source
        self.trainer_settings = trainer or TrainerSettings()
        self.mem_settings = mem or MemPSSettings(capacity_rows=4 * batch_size * max(source.n_slots, 1))
        self.ssd_settings = ssd or SSDPSSettings()
        self.transforms = list(transforms)
        self.batch_size = batch_size
        self.read_queue = read_queue
        self.queues = {"pull_queue": pull_queue, "load_queue": load_queue, "write_back_queue": write_back_queue}
        self.address = address
        self.name = name or f"hpsray-{uuid.uuid4().hex[:6]}"
        if nodes is not None and nodes < 1:
            raise ValueError(f"nodes must be >= 1 (or None for every alive node), got {nodes}")
        self.n_nodes = nodes
        self.sync = sync or SyncSettings()
        if self.trainer_settings.n_devices > 1 and self.sync.consistency != "bsp":
            raise ValueError(
                f"n_devices = {self.trainer_settings.n_devices} runs the device mesh, which synchronises BSP; "
                f"consistency = {self.sync.consistency!r} needs n_devices = 1 (one trainer process per node)"
            )
        self._aggregators: list | None = None
        self.config = self.trainer_settings.config
        self._nodes: list[NodeActors] = []
        self._tmp: str | None = None
        self._started_ray = False
        self._next_batch = 0  # batch ids continue across fit() calls
        self._pass_first: int | None = None  # first batch id of a pass in progress (a resume's)
        self.checkpoint_settings = checkpoint
        self._checkpoints = open_checkpoints(checkpoint.directory, checkpoint.keep) if checkpoint else None
        self._checkpointed: int | None = None  # batches trained at the newest checkpoint
        self._costs = CheckpointCosts()
        self._generation = 0  # collective groups formed by recoveries
        self._lost_nodes: set[str] = set()  # Ray nodes a recovery gave up: not used again until a new start
        self.recovery: list[dict] = []
        self.reshaped: dict | None = None  # a resume on another number of nodes: from, to, seconds
        self.report: RunReport | None = None  # the last fit()'s
        self.progress_seconds = progress_seconds_of(progress_seconds)  # ValueError: a negative one
        self._checkpoint_path: str | None = None
        # wall-clock (time.time) origin of the next fit()'s time_to_first_batch_s: its call unless
        # a caller sets it before (hpsray train: the command's start)
        self.started_at: float | None = None
        self.start_s: dict[str, float] = {}  # the start's seconds: ray_init_s, actors_s
        self.preflight = preflight  # the first fit() checks what hpsray train checks

    @property
    def fingerprint(self) -> str:
        """What a checkpoint must match to be resumed by this pipeline: the model, optimizers,
        source and batch size (not the number of nodes: :mod:`~hpsray.checkpoint.reshard`)."""
        return job_fingerprint(
            {
                "config": repr(self.config),
                "source": re.sub(r" at 0x[0-9a-fA-F]+", "", repr(self.source)),  # a default repr: class only
                "admission": [self.mem_settings.admit_after, self.mem_settings.expire_after_batches],
                "batch_size": self.batch_size,
                "row_width": self.config.row_width,  # not the nodes: a checkpoint resumes on any shape
            }
        )

    # -- actors --------------------------------------------------------------------------

    def _start(self, restore: Checkpoint | None = None) -> None:
        """Start the stage actors (once); with ``restore``, in that checkpoint's state."""
        if self._nodes:
            return
        t0 = time.perf_counter()
        self._started_ray = connect(self.address)
        self.start_s.setdefault("ray_init_s", time.perf_counter() - t0)  # hpsray train sets its own
        stage = self.checkpoint_settings
        if restore is None and stage is not None and stage.resume and self._checkpoints is not None:
            restore = self._checkpoints.latest(self.fingerprint)
            if restore is None:
                raise CheckpointError(str(self._checkpoints.directory), "no checkpoint to resume from")
        alive = training_nodes()
        n_nodes = self.n_nodes or len(alive)
        if n_nodes > len(alive):
            raise ValueError(
                f"the pipeline asks for {n_nodes} nodes but the Ray cluster has {len(alive)} alive; "
                "start more nodes (ray start --address=...) or lower cluster.nodes"
            )
        if restore is not None and self._checkpoints is not None:
            restore, self.reshaped = reshape(self._checkpoints, restore, n_nodes, self.ssd_settings.options)
        ssd_path = self.ssd_settings.path
        if ssd_path is None:
            self._tmp = ssd_path = self._tmp or tempfile.mkdtemp(prefix="hpsray-ssd-")
        for i, node in enumerate(alive[:n_nodes]):
            snapshot = snapshot_of(restore, i) if restore is not None else None
            counts = admission_of(restore, i) if restore is not None else None
            self._nodes.append(place_node(self, i, node, n_nodes, f"{ssd_path}/node-{i}", snapshot, counts))
        if needs_group(n_nodes, self.trainer_settings.n_devices):
            # forming the group waits for the trainers: the readers start beside them, not after
            # (fit() opens them again where its pass starts)
            for actors in self._nodes:
                self._open_reader(actors, self.source, actors.index, n_nodes)
            self._aggregators = join_group(self.name, self._nodes, self.sync, n_devices=self.trainer_settings.n_devices)
        if restore is not None:
            load_trainers(restore, self._nodes)
            self._next_batch, self._pass_first = restore.batch, int(restore.meta["pass_first"])
            self._checkpointed = restore.batch

    def _open_reader(self, node: NodeActors, source: PipelineSource, index: int, count: int, skip: int = 0) -> Any:
        return open_reader(self, node, source, index, count, len(self._nodes), skip)

    # -- training ------------------------------------------------------------------------

    def fit(self, progress: bool = True) -> dict:
        """Train one pass over the source; returns the run report's JSON form (``self.report``
        is the :class:`~hpsray.report.RunReport`).

        Each node's reader reads that node's share of the source; the batches run on the
        schedule of :class:`~hpsray.pipelines.schedule.PassSchedule`. With checkpoints, a dead
        actor (or node) restarts the stages from the newest checkpoint, up to
        ``max_failures`` times (the report's ``recovery`` lists each). Any other failure stops
        training with :class:`TrainingStopped` after every batch that trained is written back.
        """
        if self.preflight and not self._nodes:
            from hpsray.pipelines.preflight import preflight

            preflight(self)  # before any actor starts: ConfigError, CheckpointError, CapacityError
            self.preflight = False
        self._start()
        if self._pass_first is None:
            self._pass_first = self._next_batch
        first, started_at = self._pass_first, self._next_batch  # a resumed pass started before this call
        called_at = time.time()
        origin = self.started_at if self.started_at is not None else called_at
        self.started_at = None  # a later fit() counts from its own call
        total = known_examples(self.source)
        done_batches = started_at - first  # a resumed pass: its batches trained before, full ones
        done_examples = done_batches * self.batch_size * len(self._nodes)
        if total is not None and total.exact:
            done_examples = min(done_examples, total.rows)
        bar = Progress(
            total,
            progress,
            self.progress_seconds,
            checkpoint=lambda: self._checkpoint_path,
            first_batch=self._next_batch,
            done_batches=done_batches,
            done_examples=done_examples,
        )
        recovery: list[dict] = []
        self.recovery = recovery  # grows while fit() runs: one entry per recovery
        self._costs = CheckpointCosts()
        startup, wall, examples = 0.0, 0.0, {}
        self._interrupted = False
        previous = _catch_interrupt(self)
        try:
            while True:
                t_start = t0 = time.perf_counter()
                nodes = self._nodes
                bar.nodes = nodes
                schedule = PassSchedule(
                    nodes,
                    self._next_batch,
                    self.read_queue,
                    self._after_batch,
                    self.mem_settings.admit_after > 1,
                    **self.queues,
                    sync=self.sync,
                )
                try:
                    for node in nodes:  # a resumed pass skips the batches already trained
                        self._open_reader(node, self.source, node.index, len(nodes), self._next_batch - first)
                    # the actors' processes start (seconds, on the first pass) before the clock does
                    ready = _wait_ready(nodes)
                    if not startup:
                        self.start_s.update(ready)
                    t0 = time.perf_counter()
                    startup += t0 - t_start
                    bar.begin()  # the first interval starts with the pass, not with the actors
                    if self._checkpoints is not None and self._checkpointed != self._next_batch:
                        self._checkpoint(self._next_batch)  # where a failure before the first interval returns
                    schedule.run(bar)
                except Exception as e:
                    wall += time.perf_counter() - t0
                    examples.update(schedule.examples_by_batch)
                    self._recover_or_stop(e, schedule, recovery, self._next_batch + schedule.batches)
                    continue
                wall += time.perf_counter() - t0
                examples.update(schedule.examples_by_batch)
                self._next_batch += schedule.batches
                bar.pass_end()
                break
        finally:
            bar.close()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        self._pass_first = None
        trained = range(started_at, self._next_batch)
        checkpointed = self._checkpoints is not None
        self.report = run_report(
            self._nodes,
            self.sync,
            self.trainer_settings.n_devices,
            wall,
            trained,
            sum(examples.get(b, 0) for b in trained),
            schedule.edges,
            started_at=origin,
            startup_s=startup,
            start_s=self.start_s,
            checkpoints=self._costs.summary(wall) if checkpointed else None,
            recovery=recovery if checkpointed else None,
            reshaped=self.reshaped if checkpointed else None,
        )
        return self.report.as_dict()

    def _after_batch(self, batch_id: int, schedule: PassSchedule) -> None:
        """Checkpoint every ``every_batches`` batches of the pass (after the write-backs); after
        a Ctrl-C, checkpoint (or flush, without checkpoints) and stop."""
        stage = self.checkpoint_settings
        done = batch_id + 1
        if self._interrupted:
            schedule.drain()
            schedule.flush_trainers()
            self._next_batch = done
            if self._checkpoints is not None:
                self._checkpoint(done)
            else:
                ray.get([n.mem.flush.remote() for n in self._nodes])
            where = f"; resume from its checkpoint (ckpt-{done:06d})" if self._checkpoints is not None else ""
            raise KeyboardInterrupt(f"stopped after {done} batches trained, every trained row written back{where}")
        if stage is None or (done - (self._pass_first or 0)) % stage.every_batches:
            return
        schedule.drain()
        schedule.flush_trainers()
        self._checkpoint(done)

    def _checkpoint(self, batch: int) -> None:
        assert self._checkpoints is not None
        meta = {"pass_first": self._pass_first, "name": self.name}
        ckpt, seconds, size = write_checkpoint(self._checkpoints, self._nodes, batch, meta, self.fingerprint)
        self._checkpoint_path = str(ckpt.path)
        self._costs.seconds.append(seconds)
        self._costs.bytes.append(size)
        self._checkpointed = batch

    def _recover_or_stop(self, error: Exception, schedule: PassSchedule, recovery: list, failed_at: int) -> None:
        """Restart the stages from the newest checkpoint when an actor died, or a parameter file
        failed its checksum and the checkpoints are durable (object storage: the damaged file is
        fetched again), and failures are left; otherwise salvage what trained and raise
        :class:`TrainingStopped` (a damaged file: its message names the file and the rows at stake)."""
        stage = self.checkpoint_settings
        root = schedule.first_failure(error)
        actors = self.actors()
        dead = dead_actors(actors) if stage is not None else []
        damaged = caused_by(root, CorruptFileError) and getattr(self._checkpoints, "durable", False)
        if stage is None or not (dead or actor_lost(root) or damaged) or len(recovery) >= stage.max_failures:
            try:
                saved = schedule.salvage()
            except Exception:  # noqa: BLE001 - an actor is gone: what it held is in the last checkpoint
                saved = 0
            raise TrainingStopped(root, saved) from error
        t0 = time.perf_counter()
        assert self._checkpoints is not None
        restore = self._checkpoints.latest(self.fingerprint, deep=damaged)  # deep: a damaged copy is fetched again
        if restore is None:
            raise TrainingStopped(root, 0) from error
        try:
            done = restart_from(self, restore, dead)
        except Exception as e:  # noqa: BLE001 - no way back: say why, keep the checkpoint
            raise TrainingStopped(e, 0) from error
        self._next_batch, self._checkpointed = restore.batch, restore.batch
        recovery.append(
            {
                "error": f"{type(root).__name__}: {root}".splitlines()[0][:300],
                "dead": dead,
                "failed_at_batch": failed_at,
                "resumed_from_batch": restore.batch,
                "replayed_batches": max(failed_at - restore.batch, 0),
                "restart_s": time.perf_counter() - t0,
                **done,
            }
        )

    # -- using the trained model ---------------------------------------------------------

    def evaluate(self, source: PipelineSource) -> dict:
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
        release_placements(f"{self.name}:")
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


_STAGES = ("read", "pull", "load", "train")


def _wait_ready(nodes: list[NodeActors]) -> dict[str, float]:
    """Wait until every stage actor's process is up; returns the seconds until each stage's
    slowest actor was (read, pull, load, train), the start's breakdown in the report."""
    t0 = time.perf_counter()
    stage = {}
    for node in nodes:
        for name, actor in zip(_STAGES, (node.reader, node.mem, node.ssd, node.trainer)):
            if actor is not None:
                stage[actor.__ray_ready__.remote()] = name
    ready: dict[str, float] = {}
    pending = list(stage)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises an actor's failed start
        ready[stage[done[0]]] = time.perf_counter() - t0
    return ready


def _catch_interrupt(pipeline: Pipeline) -> Any:
    """In the main thread, make the first Ctrl-C ask ``pipeline`` to stop at the next batch
    boundary (a second one interrupts at once); returns the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def ask_to_stop(signum, frame):
        pipeline._interrupted = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    return signal.signal(signal.SIGINT, ask_to_stop)
