"""``Trainer``: the actor over a node's :class:`~hpsray.training.engine.TrainerEngine`. It resolves
its inputs, joins the collectives (which picks the node's strategy once,
:mod:`hpsray.training.strategies`), starts the node's other device processes, checkpoints, and
answers Ray; a batch is one call of the strategy."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch

from hpsray.actors import joining
from hpsray.actors.ahead import AHEAD_GROUP, RETURNS_GROUP, Ahead, Handover
from hpsray.actors.devices import a_worker_died, start_device_workers
from hpsray.actors.livemetrics import LiveGauges
from hpsray.actors.messages import DevicePart, Returned, TrainData, TrainInputs, TrainOutcome, TrainReturns
from hpsray.actors.timing import StageClock
from hpsray.actors.working_set import fetch_upcoming, keep_masks
from hpsray.cluster import faults
from hpsray.cluster.mesh import rendezvous_address
from hpsray.cluster.updates import crosses_batches
from hpsray.config import TrainConfig
from hpsray.data.batch import Batch
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.warmup import warm_trainer_step
from hpsray.training import state
from hpsray.training.devices import DeviceSteps, join_kept
from hpsray.training.engine import TrainerEngine
from hpsray.training.strategies import KeepMasks, LocalSteps, Strategy

if TYPE_CHECKING:
    from hpsray.pipelines.settings import SyncSettings


class Trainer:
    """Trains each batch on its working set (paper Algorithm 1, step 4) through its strategy.

    ``node`` of ``n_nodes``; ``config``: model shape, optimizers, mini-batch size, seed;
    ``n_slots``, ``n_dense``: input shape; ``capacity``: rows the working set of two consecutive
    batches may hold; ``n_devices``: ``D`` processes per node (docs/architecture.md: Devices),
    this actor device 0 (it starts the others, ``device_index`` 1 .. D-1, in ``placement`` on
    CUDA, named after ``name``); ``device``: ``"cpu"`` or ``"cuda"`` (the table and the whole
    step); ``model``: ``(pooled [B, n_slots, dim], dense) -> logits`` (``None``: the kind
    ``config`` names); ``threads``: torch intra-op threads (default: all cores).
    """

    def __init__(
        self,
        node: int,
        n_nodes: int,
        config: TrainConfig,
        n_slots: int,
        n_dense: int,
        capacity: int,
        n_devices: int = 1,
        device: str = "cpu",
        model: torch.nn.Module | None = None,
        threads: int | None = None,
        device_index: int = 0,
        placement: Any = None,
        name: str | None = None,
    ) -> None:
        self.node, self.config = node, config  # first, so repr() works if the rest fails
        self.n_nodes, self.n_devices, self.device_index = n_nodes, n_devices, device_index
        self.threads = threads or os.cpu_count() or 1
        torch.set_num_threads(self.threads)
        # with D devices, this process holds one device's share of the node's working set
        share = capacity if n_devices == 1 else int(np.ceil(capacity / n_devices * 1.25)) + 64
        self.workers: list[Any] = []  # device 0 starts the node's other D - 1 (actor handles)
        if n_devices > 1 and device_index == 0:  # before the model moves to this device
            args = (node, n_nodes, config, n_slots, n_dense, capacity, n_devices, device, model, threads)
            self.workers = start_device_workers(Trainer, args, placement, name)
        self.engine = TrainerEngine(config, n_slots, n_dense, share, n_nodes, device, model)
        self.clock = StageClock("train", node)
        self.gauges = LiveGauges(stage="train", node=node)
        self.strategy: Strategy = LocalSteps(self.engine, self.clock.timed)  # until join
        self.crosses_batches = False  # SSP/ASP: the clock runs across batch ends (from join)
        self._pending: list[Any] = []  # the other devices' parts of the batch in flight (refs)
        self.ahead = Ahead()  # batches' inputs fetched on the second thread (fetch_ahead)
        self.handover = Handover()  # batches' rows, stored by the third thread (returned)
        self.fetched_ahead = 0  # batches trained on inputs fetched ahead
        # the table's numba kernels compile here, before the pipeline's clock
        width, init = config.row_width, config.row_init()
        warm_trainer_step(HbmPS(256, width, init, 1, n_nodes, device), init, width, n_slots, n_dense)

    hbm = property(lambda self: self.engine.hbm)
    step = property(lambda self: self.engine.step)
    group = property(lambda self: self.strategy.group)  # BSP and relaxed only

    def __repr__(self) -> str:
        return f"Trainer[node {self.node}]" + (f"[device {self.device_index}]" if self.n_devices > 1 else "")

    def join(
        self,
        world: int,
        group: str,
        sync: SyncSettings,
        aggregators: Sequence[Any] | None = None,
        board: Any = None,
        mesh_address: str | None = None,
    ) -> int:
        """Join the trainers' collectives (every trainer calls this at once) and pick the node's
        strategy (:mod:`hpsray.actors.joining`): ``sync`` is the pipeline's
        :class:`~hpsray.pipelines.SyncSettings`; relay propagation uses ``board``; with ``D > 1``
        devices the node's device processes join the device mesh at ``mesh_address``."""
        faults.configure(getattr(sync, "fault_timeout_s", None))  # every wait on a peer ends within it
        self.strategy.close()  # a re-formed group: the old one's streams end
        self.crosses_batches = crosses_batches(sync)
        if self.n_devices > 1:
            assert mesh_address is not None  # the pipeline gives it with D > 1 devices
            chunked = sync.dense == "chunked" and world > 1  # device 0 of each node aggregates across nodes
            refs = [w.join_mesh.remote(mesh_address, world, chunked) for w in self.workers]
            self.join_mesh(mesh_address, world, chunked, aggregators, sync)
            _get(refs)
            return self.node
        self.strategy = joining.join_group(self, world, group, sync, aggregators, board)
        return self.node

    def mesh_address(self) -> str:
        """Where the device mesh meets (node 0's trainer: this node's address, a free port)."""
        return rendezvous_address()

    def join_mesh(
        self,
        address: str,
        n_nodes: int,
        chunked: bool = False,
        aggregators: Sequence[Any] | None = None,
        sync: Any = None,
    ) -> int:
        """Join the device mesh (every device process of every node calls this at once);
        ``chunked``: dense gradients summed per node, then across nodes by device 0's aggregator."""
        self.strategy.close()
        self.strategy = joining.join_mesh(
            self, address, n_nodes, chunked, aggregators, sync, lambda: _get(self._pending)
        )
        return self.node * self.n_devices + self.device_index  # its rank in the mesh

    def train(self, batch_id: Hashable, inputs: TrainInputs) -> TrainOutcome:
        """Train a batch on its working set; its rows go back to their owners through
        :meth:`returned` (another thread), so this returns the :class:`TrainOutcome` alone.
        Trainers of several nodes step through the same number of global mini-batches
        (``inputs.sizes``); if one lacks its inputs, all fail the batch together."""
        try:
            out, outcome = self._train(batch_id, inputs)
        except BaseException as e:
            self.handover.give(batch_id, error=e)
            raise
        self.handover.give(batch_id, out[0] if len(out) == 1 else tuple(out))
        return outcome

    @ray.method(concurrency_group=RETURNS_GROUP)
    def returned(self, batch_id: Hashable) -> TrainReturns | Returned:
        """Batch ``batch_id``'s rows to their owners, one :class:`Returned` per owner node (call
        with ``.options(num_returns=n_nodes)``, so each owner's write-back fetches only its part),
        once its :meth:`train` ends; raises the error that ended it."""
        return self.handover.take(batch_id)

    def _train(self, batch_id: Hashable, inputs: TrainInputs) -> tuple[list[Returned], TrainOutcome]:
        self._pending = [w.train_part.remote(batch_id, inputs) for w in self.workers]
        if torch.get_num_threads() != self.threads:  # a threaded actor's calls may run on a new thread
            torch.set_num_threads(self.threads)
        ahead = self.ahead.take(batch_id)
        if ahead is None:
            got, keep = self._resolve(batch_id, inputs), self._keep(inputs)
        else:
            got, keep = ahead.inputs(), self._keep(inputs, ahead.upcoming)
            self.fetched_ahead += 1
        try:
            result = self.strategy.run_batch(batch_id, got, inputs.sizes, keep)
        except Exception:
            if a_worker_died(self._pending):  # restart this node's trainer: its device processes die with it
                os._exit(1)
            raise
        stamp = result.stamp or ()
        out = [Returned(self.node, keys, rows, *stamp) for keys, rows in result.returned]
        per_s = result.examples / max(self.clock.per_batch[batch_id], 1e-9)
        self.gauges.set(loss=result.loss, examples_per_s=per_s)
        self.gauges.set_sync(self.strategy.max_staleness, self.strategy.sent)
        return out, TrainOutcome(result.loss, result.examples)

    @ray.method(concurrency_group=AHEAD_GROUP)
    def fetch_ahead(self, batch_id: Hashable, inputs: TrainInputs) -> None:
        """Fetch batch ``batch_id``'s inputs, then the next batch's keys, on this actor's second
        thread while the batch before trains (:mod:`hpsray.actors.ahead`); :meth:`train` takes
        them. Never raises: an error is kept for :meth:`train`, which reports it."""
        fetch = self.ahead.start(batch_id)
        fetch.run(lambda: self._resolve(batch_id, inputs), lambda: self._upcoming(inputs))

    def train_part(self, batch_id: Hashable, inputs: TrainInputs) -> DevicePart:
        """A device process's part of a batch (called by device 0 of its node)."""
        steps = self.strategy
        if not isinstance(steps, DeviceSteps):
            raise RuntimeError(f"{self!r} trains before joining the device mesh (Pipeline forms it)")
        return steps.run_part(batch_id, self._resolve(batch_id, inputs), inputs.sizes, self._keep(inputs))

    def _resolve(self, batch_id: Hashable, inputs: TrainInputs) -> TrainData | Exception:
        """The batch's inputs, or the error getting them (the strategy tells the peers, raises it);
        the read stage's layout staged for the upload here (off the training thread when
        fetched ahead: :meth:`fetch_ahead`)."""
        try:
            data = inputs.resolve(lambda refs: faults.get(refs, f"batch {batch_id}'s inputs"))
            return data if data.layout is None else dataclasses.replace(data, layout=self.engine.stage(data.layout))
        except Exception as e:  # noqa: BLE001 - raised by the strategy, after telling the peers
            return e

    def _keeps(self, inputs: TrainInputs) -> bool:
        """Whether this node keeps rows the next batch needs (else an owner may need any back)."""
        return not (self.n_nodes > 1 and (not inputs.must_return or self.crosses_batches))

    def _upcoming(self, inputs: TrainInputs) -> Any:
        """The next batch's keys and the keys owners need back (``fetch_upcoming``), when kept."""
        return fetch_upcoming(inputs.next_batch, inputs.must_return) if self._keeps(inputs) else None

    def _keep(self, inputs: TrainInputs, upcoming: Callable[[], Any] | None = None) -> KeepMasks:
        """Per owner, which keys of this batch stay here at its end (``None``: none);
        ``upcoming``: the next batch's keys fetched ahead (else fetched at the batch's end)."""
        if not self._keeps(inputs):
            return lambda keys: None  # an owner may need any of them back
        fetched = upcoming if upcoming is not None else lambda: self._upcoming(inputs)

        def keep(keys: list[np.ndarray]) -> list[np.ndarray] | None:
            got = fetched()
            return None if got is None else keep_masks(keys, *got)

        return keep

    def settle(self, batch_id: Hashable) -> tuple[Returned, ...]:
        """The final barrier of a pass under SSP/ASP (after the last batch's ``train``): every
        other trainer's updates in, the last batch's rows back, complete, one :class:`Returned`
        per owner (call with ``.options(num_returns=n_nodes)``)."""
        with self.clock.timed(batch_id):
            back = self.strategy.settle()
        return tuple(Returned(self.node, k, rows, self.engine.step, None) for k, rows in back)

    def flush(self) -> list[Returned]:
        """The rows this node kept at the last batch's end, one :class:`Returned` per owner (empty
        when none), for ``MemPSShard.store_kept``: before a checkpoint, at a stop, after a
        failure. They stay resident."""
        theirs = [[(r.keys, r.rows) for r in part] for part in _get([w.flush.remote() for w in self.workers])]
        return [Returned(self.node, ks, rs) for ks, rs in join_kept(self.engine, theirs)]

    def predict(self, batch: Batch, keys: list, rows: list) -> np.ndarray:
        """Click probabilities of ``batch`` given, per owner, refs of its keys and their rows."""
        values = _get([*keys, *rows])
        n = len(keys)
        return self.engine.predict(batch, np.concatenate(values[:n]), np.concatenate(values[n:]))

    def dense_state(self) -> dict:
        """The dense model's parameters (replica 0; all replicas are equal)."""
        return state.dense_state(self.engine)

    def save_state(self, path: str) -> int:
        """Write what continuing exactly needs to ``path`` (a checkpoint's file); its bytes."""
        return state.save_state(self.engine, path)

    def reset(self, path: str) -> int:
        """Forget the working set and continue from :meth:`save_state`'s file (a recovery that
        keeps this process); returns the step restored."""
        refs = [w.reset.remote(path) for w in self.workers]
        self.strategy.forget()
        self.ahead.clear()
        self.handover.clear()
        return self._load_own_state(path, refs)

    def load_state(self, path: str) -> int:
        """Continue from :meth:`save_state`'s file (every device process of the node: their
        dense replicas are equal); returns the step restored."""
        return self._load_own_state(path, [w.load_state.remote(path) for w in self.workers])

    def _load_own_state(self, path: str, theirs: list) -> int:
        step = state.load_state(self.engine, path)
        self.strategy.restart_clocks()  # the relaxed modes' clocks restart from the restored step
        _get(theirs)
        return step

    def replicas_equal(self) -> bool:
        """Whether the dense replicas of every device process of this node are equal."""
        ref, theirs = self.dense_state(), _get([w.dense_state.remote() for w in self.workers])
        return all(torch.equal(ref[k], other[k]) for other in theirs for k in ref)

    def stats(self) -> dict:
        sent = self.strategy.sent
        return {
            **self.clock.snapshot(),
            "examples": self.engine.examples,
            "steps": self.engine.step,
            "losses": dict(self.engine.losses),
            "exchanged_bytes_per_step": float(np.mean(sent)) if sent else 0.0,
            **self.strategy.staleness(),
            "traffic": self.engine.traffic.snapshot(),
            "fetched_ahead": self.fetched_ahead,
        }


def _get(refs: list) -> list:
    import ray

    return ray.get(refs) if refs else []
