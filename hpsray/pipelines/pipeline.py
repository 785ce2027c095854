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
from hpsray.errors import CheckpointError, CorruptFileError, PrivateControlFlow, TrainingStopped, caused_by
from hpsray.evaluation import EvalSettings
from hpsray.pipelines.passes import Evaluations, catch_interrupt, check_passes, score
from hpsray.pipelines.placement import (
    NodeActors,
    actor_handles,
    join_group,
    needs_group,
    open_reader,
    place_node,
    release_placements,
    scan_rows,
    stop_actors,
)
from hpsray.pipelines.preflight import preflight
from hpsray.pipelines.progress import Progress, known_examples
from hpsray.pipelines.progress import progress_seconds as progress_seconds_of
from hpsray.pipelines.recovery import (
    CheckpointCosts,
    actor_lost,
    admission_of,
    dead_actors,
    fetch_shards,
    load_trainers,
    recovery_entry,
    reshape,
    restart_from,
    snapshot_of,
    write_checkpoint,
)
from hpsray.pipelines.schedule import PassSchedule
from hpsray.pipelines.settings import CheckpointSettings, MemPSSettings, SSDPSSettings, SyncSettings, TrainerSettings
from hpsray.pipelines.sources import PipelineSource
from hpsray.pipelines.summary import close_window, run_report
from hpsray.pipelines.tensorboard import TensorBoardLog
from hpsray.report import RunReport
from hpsray.tables import admits_late, check_tables, key_tagging


class _EndPass(PrivateControlFlow):
    """Raised by ``Pipeline._after_batch`` when early stopping says to stop; caught by
    ``Pipeline._fit_pass``, which ends the pass there as if the source had ended."""


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
        passes: passes over the source that ``fit()`` trains (``[pipeline] passes``).
        evaluation: evaluate on ``eval_source`` while training, every ``every_batches`` batches
            and at each pass's end, with early stopping (:class:`~hpsray.evaluation.EvalSettings`;
            ``None``: no evaluation while training).
        eval_source: the held-out examples (required with ``evaluation``).
        tensorboard: a directory for TensorBoard scalars (:mod:`~hpsray.pipelines.tensorboard`).
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
        passes: int = 1,
        evaluation: EvalSettings | None = None,
        eval_source: PipelineSource | None = None,
        tensorboard: str | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        check_passes(passes, evaluation, eval_source)
        queues = {"read_queue": read_queue, "pull_queue": pull_queue, "load_queue": load_queue}
        for edge, capacity in {**queues, "write_back_queue": write_back_queue}.items():
            if capacity < 1:
                raise ValueError(f"{edge} must be >= 1, got {capacity}")
        self.source = source
        self.trainer_settings = (trainer or TrainerSettings()).bound(source.n_slots)  # hpsray.first_order
        self.model_slots = self.trainer_settings.config.tables_for(source.n_slots).n_slots  # copied slots too
        self.mem_settings = mem or MemPSSettings(capacity_rows=4 * batch_size * self.model_slots)
        self.ssd_settings = ssd or SSDPSSettings()
        self.transforms = list(transforms) + key_tagging(self.trainer_settings.config, source.n_slots)  # tags last
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
        check_tables(self.config, source.n_slots)
        self._nodes: list[NodeActors] = []
        self._tmp: str | None = None
        self._started_ray = False
        self._next_batch = 0  # batch ids continue across fit() calls
        self._interrupted = False  # interrupt(): stop at the next batch end (cleared there)
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
        # time.time() origin of the next fit()'s time_to_first_batch_s: its call, unless set before
        self.started_at: float | None = None  # (hpsray train sets the command's start)
        self.start_s: dict[str, float] = {}  # the start's seconds: ray_init_s, actors_s
        self.preflight = preflight  # the first fit() checks what hpsray train checks
        self.passes = passes
        self._pass_index = 0  # passes completed (a resume's come from its checkpoint)
        self._pass_goal = passes  # fit() trains until this many are complete
        self.evaluations = Evaluations(evaluation, eval_source) if evaluation and eval_source is not None else None
        self.board = TensorBoardLog(tensorboard) if tensorboard else None
        if self.evaluations is not None:
            self.evaluations.board = self.board

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
        if restore is not None:  # each node's files onto its host (object storage: a host's disk may be empty)
            fetch_shards(self._checkpoints, restore, [(i, node["NodeID"]) for i, node in enumerate(alive[:n_nodes])])
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
            self._pass_index = int(restore.meta.get("pass_index", 0))
            self._checkpointed = restore.batch

    def _open_reader(self, node: NodeActors, source: PipelineSource, index: int, count: int, skip: int = 0) -> Any:
        return open_reader(self, node, source, index, count, len(self._nodes), skip)

    # -- training ------------------------------------------------------------------------

    def fit(self, progress: bool = True) -> dict:
        """Train ``passes`` passes over the source (those a resumed run has left); returns the run
        report's JSON form (``self.report`` is the :class:`~hpsray.report.RunReport`).

        Each node's reader reads that node's share of the source; the batches run on the
        schedule of :class:`~hpsray.pipelines.schedule.PassSchedule`. With checkpoints, a dead
        actor (or node) restarts the stages from the newest checkpoint, up to
        ``max_failures`` times (the report's ``recovery`` lists each). Any other failure stops
        training with :class:`TrainingStopped` after every batch that trained is written back.
        With ``evaluation``, the model is scored every ``every_batches`` batches and at each
        pass's end; early stopping ends the run (:mod:`~hpsray.pipelines.passes`). A later
        ``fit()`` trains ``passes`` more.
        """
        called_at = time.time()  # time_to_first_batch_s counts the start (Ray, the actors) too
        if self.preflight and not self._nodes:
            preflight(self)  # before any actor starts: ConfigError, CheckpointError, CapacityError
            self.preflight = False
        self._start()
        started_at = self._next_batch
        origin = self.started_at if self.started_at is not None else called_at
        self.started_at = None  # a later fit() counts from its own call
        recovery: list[dict] = []
        self.recovery = recovery  # grows while fit() runs: one entry per recovery
        self._costs = CheckpointCosts()
        acc: dict[str, Any] = {"startup": 0.0, "wall": 0.0, "examples": {}, "windows": []}
        previous = catch_interrupt(self.interrupt)
        stopped = False
        if self._pass_index >= self._pass_goal:  # a later fit(): as many passes again
            self._pass_goal = self._pass_index + self.passes
        try:
            while self._pass_index < self._pass_goal and not stopped:
                schedule, stopped = self._fit_pass(progress, recovery, acc)
                self._pass_first = None
                self._pass_index += 1
                evals = self.evaluations
                if evals is not None and not stopped:
                    evals.evaluate(self, self._nodes, self._next_batch, self._pass_index - 1)
                    stopped = evals.track.stop
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        trained = range(started_at, self._next_batch)
        checkpointed = self._checkpoints is not None
        self.report = run_report(
            self._nodes,
            self.sync,
            self.trainer_settings,
            acc["wall"],
            trained,
            sum(acc["examples"].get(b, 0) for b in trained),
            schedule.edges,
            started_at=origin,
            startup_s=acc["startup"],
            start_s=self.start_s,
            checkpoints=self._costs.summary(acc["wall"]) if checkpointed else None,
            recovery=recovery if checkpointed else None,
            reshaped=self.reshaped if checkpointed else None,
            windows=acc["windows"],
        )
        if self.evaluations is not None:
            self.report.evaluations = {**self.evaluations.track.as_dict(), "seconds": self.evaluations.seconds}
        return self.report.as_dict()

    def _fit_pass(self, progress: bool, recovery: list[dict], acc: dict[str, Any]) -> tuple[PassSchedule, bool]:
        """One pass (or a resumed pass's rest), recovering from dead actors; adds its startup and
        wall seconds and examples per batch to ``acc``. Returns its last schedule and whether early
        stopping ended it."""
        if self._pass_first is None:
            self._pass_first = self._next_batch
        first = self._pass_first
        total = known_examples(self.source)
        done_batches = self._next_batch - first  # a resumed pass: its batches trained before, full ones
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
            desc="hpsray" if self.passes == 1 else f"pass {self._pass_index + 1}/{self.passes}",
            evaluation=self.evaluations.latest if self.evaluations is not None else None,
            board=self.board,
        )
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
                    admits_late(self.config, self.source.n_slots, self.mem_settings.admit_after),
                    **self.queues,
                    sync=self.sync,
                )
                stopped = False
                try:
                    for node in nodes:  # a resumed pass skips the batches already trained
                        self._open_reader(node, self.source, node.index, len(nodes), self._next_batch - first)
                    # the actors' processes start (seconds, on the first pass) before the clock does;
                    # the fill overlaps the trainers' start unless a checkpoint comes first
                    due = self._checkpoints is not None and self._checkpointed != self._next_batch
                    ready, t0 = schedule.begin(prefill=not due)
                    if not acc["startup"]:
                        self.start_s.update(ready)
                    acc["startup"] += t0 - t_start
                    bar.begin()  # the first interval starts with the pass, not with the actors
                    if due:
                        self._checkpoint(self._next_batch)  # where a failure before the first interval returns
                    schedule.run(bar)
                except _EndPass:
                    stopped = True
                except Exception as e:
                    close_window(acc, t0)
                    acc["examples"].update(schedule.examples_by_batch)
                    self._recover_or_stop(e, schedule, recovery, self._next_batch + schedule.batches)
                    continue
                close_window(acc, t0)
                acc["examples"].update(schedule.examples_by_batch)
                self._next_batch += schedule.batches
                bar.pass_end()
                return schedule, stopped
        finally:
            bar.close()

    def _after_batch(self, batch_id: int, schedule: PassSchedule) -> None:
        """Checkpoint every ``every_batches`` batches, after the write-backs; interrupted: checkpoint or flush, stop."""
        stage = self.checkpoint_settings
        done = batch_id + 1
        if self._interrupted:
            self._interrupted = False  # honoured: a later fit() trains on
            schedule.drain()
            schedule.flush_trainers()
            self._next_batch = done
            if self._checkpoints is not None:
                self._checkpoint(done)
            else:
                ray.get([n.mem.flush.remote() for n in self._nodes])
            where = f"; resume from its checkpoint (ckpt-{done:06d})" if self._checkpoints is not None else ""
            raise KeyboardInterrupt(f"stopped after {done} batches trained, every trained row written back{where}")
        in_pass = done - (self._pass_first or 0)
        checkpoint = stage is not None and in_pass % stage.every_batches == 0
        evals = self.evaluations
        evaluate = evals is not None and evals.due(in_pass)
        if not (checkpoint or evaluate):
            return
        schedule.drain()
        schedule.flush_trainers()
        if checkpoint:
            self._checkpoint(done)
        if evals is not None and evaluate:
            evals.evaluate(self, self._nodes, done, self._pass_index)
            if evals.track.stop:
                raise _EndPass(done)

    def _checkpoint(self, batch: int) -> None:
        assert self._checkpoints is not None
        meta = {"pass_first": self._pass_first, "pass_index": self._pass_index, "name": self.name}
        ckpt, seconds, size = write_checkpoint(self._checkpoints, self._nodes, batch, meta, self.fingerprint)
        self._checkpoint_path = str(ckpt.path)
        self._costs.seconds.append(seconds)
        self._costs.bytes.append(size)
        self._checkpointed = batch

    def _recover_or_stop(self, error: Exception, schedule: PassSchedule, recovery: list, failed_at: int) -> None:
        """Restart the stages from the newest checkpoint when an actor died, or a parameter file
        failed its checksum and the checkpoints hold a copy of it (object storage, or another file
        system than SSD-PS's: the damaged file is restored from there), and failures are left;
        otherwise salvage what trained and raise :class:`TrainingStopped` (a damaged file: its
        message names the file and the rows at stake)."""
        stage = self.checkpoint_settings
        root = schedule.first_failure(error)
        actors = self.actors()
        dead = dead_actors(actors) if stage is not None else []
        damaged = (
            caused_by(root, CorruptFileError)
            and self._checkpoints is not None
            and self._checkpoints.durable_against([self.ssd_settings.path or self._tmp or ""])
        )
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
        recovery.append(recovery_entry(root, dead, failed_at, restore.batch, time.perf_counter() - t0, done))

    # -- using the trained model ---------------------------------------------------------

    def evaluate(self, source: PipelineSource) -> dict:
        """AUC and log-loss of the trained model over ``source``'s examples (read on node 0,
        each key's row looked up at its owner): ``{"auc", "logloss", "examples"}``."""
        self._start()
        return score(self._nodes, self._open_reader(self._nodes[0], source, 0, 1))

    def interrupt(self) -> None:
        """Stop at the next batch end (before ``fit()``: its first), checkpointed or flushed, as a Ctrl-C does."""
        self._interrupted = True

    def export_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every trained row ``(keys sorted, rows)``: MEM-PS is flushed, then SSD-PS scanned."""
        self._start()
        return scan_rows(self._nodes, self.config.row_width)

    def dense_state(self) -> dict:
        """The trained dense model's ``state_dict``."""
        return ray.get(self._nodes[0].trainer.dense_state.remote())

    def actors(self) -> dict:
        """Actor handles by dashboard name."""
        return actor_handles(self._nodes)

    def shutdown(self) -> None:
        """Stop the actors (closing the SSD-PS stores) and remove a temporary SSD directory."""
        stop_actors(self._nodes, self._aggregators or [])
        if self.evaluations is not None:
            self.evaluations.close()
        if self.board is not None:
            self.board.flush()
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
