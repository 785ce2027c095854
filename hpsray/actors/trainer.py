"""``Trainer``: the actor over a node's :class:`~hpsray.training.engine.TrainerEngine`: it resolves
its inputs, joins the collectives, starts the node's other device processes, and calls the engine.
Over 500 lines: one actor's protocol (join, train, settle, flush, state), its engine already apart."""

from __future__ import annotations

import os
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hpsray.actors.devices import DevicePart, a_worker_died, start_device_workers
from hpsray.actors.livemetrics import LiveGauges
from hpsray.actors.messages import Returned, TrainInputs, TrainOutcome
from hpsray.actors.relaxed import RelaxedSteps
from hpsray.actors.timing import StageClock
from hpsray.actors.working_set import kept_masks
from hpsray.cluster import faults
from hpsray.cluster.mesh import DeviceMesh, rendezvous_address
from hpsray.cluster.updates import crosses_batches
from hpsray.config import TrainConfig
from hpsray.data.batch import Batch
from hpsray.errors import PeerFailedError
from hpsray.models.pooling import BagLayout, pool_sum
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.warmup import warm_trainer_step
from hpsray.training.devices import DeviceShare
from hpsray.training.engine import TrainerEngine

if TYPE_CHECKING:
    from hpsray.cluster.aggregation import ChunkedAggregator
    from hpsray.cluster.collective import CollectiveGroup
    from hpsray.cluster.propagation import Exchange
    from hpsray.pipelines.settings import SyncSettings


class Trainer:
    """Trains each batch on its working set (paper Algorithm 1, step 4) through its engine.

    Args:
        node, n_nodes: this node and how many there are (for the device hash).
        config: model shape, optimizers, mini-batch size, seed.
        n_slots, n_dense: input shape.
        capacity: rows the working set of two consecutive batches may hold.
        n_devices: ``D``: the node trains with ``D`` processes, one per device (one GPU each
            on CUDA), each holding the keys of its device and a dense replica. This actor is
            device 0, the node's trainer the pipeline calls; it starts the other ``D - 1``
            (``device_index`` 1 .. D-1) and they meet in a :class:`DeviceMesh` (``join``).
        device: where the whole step runs (:class:`~hpsray.training.engine.TrainerEngine`):
            ``"cpu"`` (a numba table, torch on the CPU) or ``"cuda"`` (a numba.cuda table and
            torch on this process's GPU; Ray gives the actor its own GPU with ``num_gpus=1``).
            A batch's keys, dense features and labels go to the GPU once; the loss is read
            once per batch.
        model: a module ``(pooled [B, n_slots, dim], dense) -> logits``; the DNN when ``None``.
        threads: torch intra-op threads (default: all cores).
        device_index: this process's device (0: the node's trainer).
        placement: on CUDA, the node's placement group (one GPU per bundle; bundle ``d`` for
            device ``d``); ``None`` on CPU.
        name: this actor's name, from which the other devices' are made.
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
        self.n_devices, self.device_index = n_devices, device_index
        torch.set_num_threads(threads or os.cpu_count() or 1)
        # with D devices, this process holds one device's share of the node's working set
        self._capacity = capacity if n_devices == 1 else int(np.ceil(capacity / n_devices * 1.25)) + 64
        self.workers: list = []  # device 0 (the node's trainer) starts the node's other D - 1
        if n_devices > 1 and device_index == 0:  # before the model moves to this device
            args = (node, n_nodes, config, n_slots, n_dense, capacity, n_devices, device, model, threads)
            self.workers = start_device_workers(Trainer, args, placement, name)
        self.mesh: DeviceMesh | None = None  # with D > 1 devices (see join)
        self._share: DeviceShare | None = None  # this process's share of the node's batch (join_mesh)
        self.engine = TrainerEngine(config, n_slots, n_dense, self._capacity, n_nodes, device, model)
        self.optimizer, self.device = self.engine.optimizer, self.engine.device
        self.n_nodes = n_nodes
        self.group: CollectiveGroup | None = None  # the collective group, when n_nodes > 1 (see join)
        self.dense_reducer: ChunkedAggregator | None = None
        self._chunked = False  # the device mesh sums dense gradients per node, then in chunks (join_mesh)
        self._mailbox: Any = None  # an actor handle
        self.sync: SyncSettings | None = None
        self.board: Any = None  # an actor handle
        self.exchange: Exchange | None = None  # relaxed modes: how updates propagate (see join)
        self.relaxed: RelaxedSteps | None = None  # SSP, A-BSP, ASP (see join)
        self.exchanged_bytes: list[int] = []  # per global mini-batch, this node's payload
        self._sent = 0
        self._empty = Batch.empty(n_slots, n_dense)
        self.losses: dict = {}
        self.clock = StageClock("train", node)
        self.gauges = LiveGauges(stage="train", node=node)
        # the table's numba kernels compile here, before the pipeline's clock
        warm_trainer_step(
            HbmPS(256, config.row_width, config.row_init(), 1, n_nodes, device),
            config.row_init(),
            config.row_width,
            n_slots,
            n_dense,
        )

    # the engine's state, as the relaxed steps and the device processes read and write it
    hbm = property(lambda self: self.engine.hbm, lambda self, v: setattr(self.engine, "hbm", v))
    dense = property(lambda self: self.engine.dense)
    step = property(lambda self: self.engine.step, lambda self, v: setattr(self.engine, "step", v))
    examples = property(lambda self: self.engine.examples, lambda self, v: setattr(self.engine, "examples", v))
    traffic = property(lambda self: self.engine.traffic)
    _unreturned = property(lambda self: self.engine.unreturned, lambda self, v: setattr(self.engine, "unreturned", v))

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
        """Join the trainers' collective group (every trainer calls this at once); ``sync`` is
        the pipeline's :class:`~hpsray.pipelines.SyncSettings`. Under a relaxed mode this also
        sets up how updates propagate (:mod:`hpsray.cluster.consistency`): push and pull start
        this trainer's mailbox and find the others'; relay uses ``board``. With ``D > 1``
        devices the node's device processes join the device mesh at ``mesh_address`` instead
        (:meth:`mesh_address` of node 0's trainer; BSP only)."""
        from hpsray.cluster.collective import CollectiveGroup

        timeout_s = getattr(sync, "fault_timeout_s", None)  # every wait on a peer ends within it (issue 34)
        faults.configure(timeout_s)
        if self.n_devices > 1:
            import ray

            assert mesh_address is not None  # the pipeline gives it with D > 1 devices
            chunked = sync.dense == "chunked" and world > 1  # device 0 of each node aggregates across nodes
            refs = [w.join_mesh.remote(mesh_address, world, chunked) for w in self.workers]
            self.join_mesh(mesh_address, world, chunked)
            ray.get(refs)
            self.sync = sync
            if chunked:
                from hpsray.cluster.aggregation import ChunkedAggregator

                assert aggregators is not None  # the pipeline starts them for chunked dense sync
                self.dense_reducer = ChunkedAggregator(
                    aggregators, world, self.node, chunk_bytes=sync.chunk_bytes, timeout_s=timeout_s
                )
            return self.node
        backend = "nccl" if self.hbm.device == "cuda" else "gloo"
        self.group = CollectiveGroup(world, self.node, group, backend, timeout_s=timeout_s)
        self.sync, self.board = sync, board
        if self.exchange is not None:  # a re-formed group: the old one's streams end
            self.exchange.close()
        self.exchange = None
        if sync.consistency != "bsp":
            from hpsray.cluster import consistency

            propagation = getattr(sync, "propagation", "relay")
            self.exchange, self._mailbox = consistency.join_exchange(propagation, group, world, self.node, board)
            self.relaxed = RelaxedSteps(
                self.engine, self.node, world, sync, self.exchange, self.exchanged_bytes, self._straggle
            )
        if sync.dense == "chunked":
            from hpsray.cluster.aggregation import ChunkedAggregator

            assert aggregators is not None  # the pipeline starts them for chunked dense sync
            self.dense_reducer = ChunkedAggregator(
                aggregators, world, self.node, chunk_bytes=sync.chunk_bytes, timeout_s=timeout_s
            )
        return self.node

    def mesh_address(self) -> str:
        """Where the device mesh meets (this node's address, a free port): node 0's trainer."""
        return rendezvous_address()

    def join_mesh(self, address: str, n_nodes: int, chunked: bool = False) -> int:
        """Join the device mesh (every device process of every node calls this at once);
        ``chunked``: dense gradients are summed per node, then across nodes by device 0's
        chunked aggregator."""
        self._chunked = chunked
        if self.mesh is not None:
            self.mesh.destroy()
        backend = "nccl" if self.device.is_cuda else "gloo"
        self.mesh = DeviceMesh(address, n_nodes, self.n_devices, self.node, self.device_index, backend)
        self._share = DeviceShare(self.engine, self.n_devices, self.device_index, self.mesh)
        return self.mesh.rank

    def _reduce_on_mesh(self, flat: torch.Tensor) -> torch.Tensor:
        """The dense gradient summed over the mesh: one all-reduce, or with chunked aggregation
        the node's sum first, across nodes by device 0's aggregator, then back to the node."""
        assert self.mesh is not None
        if not self._chunked:
            return self.mesh.allreduce_sum(flat)
        total = self.mesh.node_sum(flat)
        if self.dense_reducer is not None:
            total = self.dense_reducer.reduce(total, self.step)
        return self.mesh.node_broadcast(total)

    def _reduce_dense(self, flat: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        if self.dense_reducer is not None:
            out = self.dense_reducer.reduce(flat, self.step)
            self.group.bytes_sent += flat.numel() * flat.element_size()
            return out
        return self.group.allreduce_sum(flat)

    def train(self, batch_id: Hashable, inputs: TrainInputs) -> tuple:
        """Train a batch on its working set and return its rows to their owners.

        Returns one :class:`Returned` per owner node, then a :class:`TrainOutcome`; call with
        ``.options(num_returns=n_nodes + 1)`` so each owner's write-back fetches only its part.
        Trainers of several nodes step through the same number of global mini-batches
        (``inputs.sizes``; an exhausted node contributes empty ones).

        With several nodes the trainers first agree that every one of them has its inputs: if
        one failed (a bad batch, a pull over capacity), all fail this batch together instead of
        leaving the others waiting in the collective.
        """
        if self.n_devices > 1:
            return self._train_on_devices(batch_id, inputs)

        error = None
        try:
            got = inputs.resolve(lambda refs: faults.get(refs, f"batch {batch_id}'s inputs"))
            batch, key_parts, loans, refreshed = got.batch, got.keys, got.loans, got.refreshed
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the peers
            error = e
        if self.n_nodes > 1 and self.group is not None and self._peer_failed(batch_id, error):
            raise PeerFailedError(batch_id)  # "batch N failed on another node; see that trainer's error"
        if error is not None:
            raise error
        engine = self.engine
        with self.clock.timed(batch_id):
            engine.borrow(batch_id, key_parts, loans, refreshed)
            index = engine.index(batch if batch is not None else self._empty)  # find once per batch
            if self.relaxed is not None:  # SSP, A-BSP, ASP
                losses = self.relaxed.train(index, inputs.sizes)
            elif self.n_nodes == 1:
                losses = engine.train_local(index)
            else:
                assert self.group is not None  # joined: n_nodes > 1
                losses = engine.train_bsp(
                    index, inputs.sizes, self.group, self._reduce_dense, self._straggle, self._count_sent
                )
            # the losses stay on the device until here: one read per batch
            self.losses[batch_id] = engine.close_batch(losses)
        keep = self._kept(inputs, key_parts)  # waits for batch t+1's read
        with self.clock.timed(batch_id):
            out = [self._returned(keys, rows) for keys, rows in engine.give_back(batch_id, key_parts, keep)]
        done = len(batch) if batch is not None else 0
        self.gauges.set(loss=self.losses[batch_id], examples_per_s=done / max(self.clock.per_batch[batch_id], 1e-9))
        self.gauges.set_sync(self.max_staleness, self.exchanged_bytes)
        return (*out, TrainOutcome(self.losses[batch_id], done))

    @property
    def max_staleness(self) -> int:
        return self.relaxed.max_staleness if self.relaxed is not None else 0

    def _count_sent(self) -> None:
        """After a BSP step: this node's payload of it."""
        assert self.group is not None
        self.exchanged_bytes.append(self.group.bytes_sent - self._sent)
        self._sent = self.group.bytes_sent

    def _kept(self, inputs: TrainInputs, key_parts: list[np.ndarray]) -> list[np.ndarray] | None:
        """Per owner, which keys of this batch stay here at its end (``None``: none)."""
        if self.n_nodes > 1 and (not inputs.must_return or crosses_batches(self.sync)):
            return None  # an owner may need any of them back
        return kept_masks(inputs.next_batch, key_parts, inputs.must_return)

    # -- D devices: one process each (docs/architecture.md: Devices) -----------------------

    def _train_on_devices(self, batch_id: Hashable, inputs: TrainInputs) -> tuple:
        """Device 0's :meth:`train` with ``D > 1``: every device process trains its part of the
        batch (:meth:`train_part`); this one then puts the node's rows back together, one
        :class:`Returned` per owner, and the batch's loss."""
        import ray

        parts = [w.train_part.remote(batch_id, inputs) for w in self.workers]
        try:
            batch, key_parts, devices, mine = self._device_part(batch_id, inputs)
            theirs = ray.get(parts)
        except Exception:
            if a_worker_died(parts):  # restart this node's trainer: its workers die with it
                os._exit(1)
            raise
        with self.clock.timed(batch_id):
            results = [mine, *theirs]
            out = []
            for o, (keys, where) in enumerate(zip(key_parts, devices, strict=True)):
                back = mine.returned[o]
                keys, where = (keys, where) if back is None else (keys[back], where[back])
                rows = np.empty((keys.size, self.config.row_width), dtype=np.float32)
                for d, result in enumerate(results):
                    rows[where == d] = result.rows[o]
                out.append(Returned(self.node, keys, rows))
            self.traffic.returned(batch_id, sum(r.keys.size for r in out))
            shares = np.sum([r.losses for r in results], axis=0) if mine.losses else np.empty(0)
            losses = [float(x) * scale for x, scale in zip(shares, mine.scales, strict=True) if scale]
            self.losses[batch_id] = float(np.mean(losses)) if losses else float("nan")
        done = len(batch) if batch is not None else 0
        self.examples += done
        self.gauges.set(loss=self.losses[batch_id], examples_per_s=done / max(self.clock.per_batch[batch_id], 1e-9))
        return (*out, TrainOutcome(self.losses[batch_id], done))

    def train_part(self, batch_id: Hashable, inputs: TrainInputs) -> DevicePart:
        """A device process's share of a batch (called by device 0 of its node)."""
        return self._device_part(batch_id, inputs)[3]

    def _device_part(self, batch_id: Hashable, inputs: TrainInputs) -> tuple[Any, list, list, DevicePart]:
        """Borrow this device's rows of the node's loan, step through the batch's global
        mini-batches on this device's slice of each (rows and gradients exchanged with the
        node's other devices, updates with the other nodes' same device), and give back this
        device's rows of each owner's keys. Returns the batch, each owner's keys and their
        devices, and this device's :class:`DevicePart`."""
        import ray

        mesh = self.mesh
        if mesh is None:
            raise RuntimeError(f"{self!r} trains before joining the device mesh (Pipeline forms it)")
        error = None
        try:
            got = inputs.resolve(ray.get)
            batch, key_parts, loans, refreshed = got.batch, got.keys, got.loans, got.refreshed
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
            error = e
        failed = mesh.allreduce_sum(torch.tensor([0.0 if error is None else 1.0]))
        if error is not None:
            raise error
        if float(failed[0]) > 0:
            raise PeerFailedError(batch_id)
        share = self._share
        assert share is not None
        with self.clock.timed(batch_id):
            devices = share.borrow(batch_id, key_parts, loans, refreshed)
            sizes = inputs.sizes or [len(batch) if batch is not None else 0]
            shares, scales = share.train(batch, sizes, self._reduce_on_mesh, self.exchanged_bytes)
        keep = self._kept(inputs, key_parts)  # waits for batch t+1's read
        with self.clock.timed(batch_id):
            rows_back, back = share.give_back(key_parts, devices, keep)
        return batch, key_parts, devices, DevicePart(rows_back, shares, scales, back)

    def _straggle(self, clock: int) -> None:
        """``SyncSettings(straggler_delay_s=...)``: the trainer of ``straggler_node`` sleeps before
        mini-batch ``clock`` for a seeded delay, ``delay * U(0, 2)`` with probability
        ``straggler_probability`` (the same delays in every mode, for experiments)."""
        sync = self.sync
        delay = getattr(sync, "straggler_delay_s", 0.0) if sync is not None else 0.0
        if sync is None or not delay or self.node != sync.straggler_node:
            return
        rng = np.random.default_rng([sync.straggler_seed, self.node, clock])
        if rng.random() < sync.straggler_probability:
            time.sleep(delay * rng.uniform(0.0, 2.0))

    def _returned(self, keys: np.ndarray, rows: np.ndarray) -> Returned:
        """This trainer's ``rows`` of ``keys`` for their owner; under SSP/ASP stamped with its
        clock and the oldest clock of the others it holds (the owner keeps the freshest copy)."""
        clock, oldest = self.relaxed.stamp(keys) if self.relaxed is not None else (None, None)
        if clock is None:
            return Returned(self.node, keys, rows)
        return Returned(self.node, keys, rows, clock, oldest)

    def settle(self, batch_id: Hashable) -> tuple:
        """The final barrier of a pass under SSP/ASP (the schedule calls it after the last
        batch's ``train``): wait for every other trainer's last clock, apply all their updates,
        and return the last batch's rows, complete, one :class:`Returned` per owner (call with
        ``.options(num_returns=n_nodes)``)."""
        assert self.relaxed is not None, "settle: only under ssp/asp"
        with self.clock.timed(batch_id):
            out = [Returned(self.node, k, rows, self.step, None) for k, rows in self.relaxed.settle()]
        return tuple(out)

    def flush(self) -> list[Returned]:
        """The rows this node kept at the last batch's end instead of returning them, one
        :class:`Returned` per owner (empty when it kept none), for
        ``MemPSShard.store_kept``: before a checkpoint, at a stop, after a failure. The rows
        stay resident; the next batch's end returns or keeps them as usual."""
        theirs = _get([w.flush.remote() for w in self.workers])
        out = []
        for o, (keys, rows) in enumerate(self.engine.flush()):
            parts = [(keys, rows), *((t[o].keys, t[o].rows) for t in theirs)]
            self.traffic.flushed += sum(p[0].size for p in parts[1:])
            ks, rs = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
            out.append(Returned(self.node, ks, rs))
        return out

    def _peer_failed(self, batch_id: Hashable, error: BaseException | None) -> bool:
        """Whether another node's trainer failed ``batch_id`` (its inputs). BSP and A-BSP agree
        on that in the collective, a barrier; under SSP/ASP a trainer that failed tells the
        others through the exchange instead (their waits raise :class:`PeerFailedError`)."""
        if crosses_batches(self.sync) and self.exchange is not None:
            if error is not None:
                self.exchange.fail(batch_id)
            return False
        assert self.group is not None
        failed = self.group.allreduce_sum(torch.tensor([0.0 if error is None else 1.0]))
        return error is None and float(failed[0]) > 0

    @torch.no_grad()
    def predict(self, batch: Batch, keys: list, rows: list) -> np.ndarray:
        """Click probabilities of ``batch`` given, per owner node, refs of its keys and of their
        current rows."""
        import ray

        values = ray.get([*keys, *rows])
        all_keys, all_rows = np.concatenate(values[: len(keys)]), np.concatenate(values[len(keys) :])
        order = np.argsort(all_keys)
        all_keys, all_rows = all_keys[order], all_rows[order]
        model = self.dense.models[0]
        model.eval()
        out = []
        dim, dev = self.config.dim, self.device
        for mb in batch.minibatches(self.config.minibatch_size):
            layout = BagLayout.of(mb)
            emb = dev.tensor(np.ascontiguousarray(all_rows[np.searchsorted(all_keys, layout.unique_keys), :dim]))
            out.append(torch.sigmoid(model(pool_sum(emb, layout), dev.tensor(mb.dense))).cpu().numpy())
        return np.concatenate(out) if out else np.empty(0, np.float32)

    def dense_state(self) -> dict:
        """The dense model's parameters (replica 0; all replicas are equal)."""
        return {k: v.detach().cpu().clone() for k, v in self.dense.models[0].state_dict().items()}

    def save_state(self, path: str) -> int:
        """Write what continuing exactly needs to ``path`` (a checkpoint's file): the dense
        weights and optimizer state of every replica, the mini-batch step, the losses so far
        and torch's random state; returns the bytes written."""
        state = {
            "models": [m.state_dict() for m in self.dense.models],
            "optimizers": [o.state_dict() for o in self.dense.optimizers],
            "step": self.step,
            "examples": self.examples,
            "losses": dict(self.losses),
            "rng": torch.get_rng_state(),
        }
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(state, path)
        return os.path.getsize(path)

    def reset(self, path: str) -> int:
        """Forget the working set and continue from :meth:`save_state`'s file (a recovery that
        keeps this process); returns the step restored."""
        refs = [w.reset.remote(path) for w in self.workers]
        self.engine.forget()
        if self.relaxed is not None:
            self.relaxed.forget()
        step = self._load_own_state(path)
        _get(refs)
        return step

    def load_state(self, path: str) -> int:
        """Continue from :meth:`save_state`'s file (every device process of the node: their
        dense replicas are equal); returns the step restored."""
        refs = [w.load_state.remote(path) for w in self.workers]
        step = self._load_own_state(path)
        _get(refs)
        return step

    def _load_own_state(self, path: str) -> int:
        state = torch.load(path, map_location=self.device.torch, weights_only=False)
        for model, saved in zip(self.dense.models, state["models"], strict=True):
            model.load_state_dict(saved)
        for optimizer, saved in zip(self.dense.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        self.step, self.examples = int(state["step"]), int(state["examples"])
        self.losses = dict(state["losses"])
        torch.set_rng_state(state["rng"])
        if self.relaxed is not None:
            self.relaxed.restart_clocks()
        return self.step

    def replicas_equal(self) -> bool:
        """Whether the dense replicas of every device process of this node are equal."""
        ref = self.dense_state()
        return all(
            torch.equal(ref[k], other[k]) for other in _get([w.dense_state.remote() for w in self.workers]) for k in ref
        )

    def stats(self) -> dict:
        sent = self.exchanged_bytes
        carry = self.relaxed.carry if self.relaxed is not None else None
        return {
            **self.clock.snapshot(),
            "examples": self.examples,
            "steps": self.step,
            "losses": dict(self.losses),
            "exchanged_bytes_per_step": float(np.mean(sent)) if sent else 0.0,
            "max_staleness": self.max_staleness,
            "max_staleness_across_batches": carry.max_across if carry is not None else 0,
            "max_return_staleness": carry.max_return if carry is not None else 0,
            "traffic": self.traffic.snapshot(),
        }


def _get(refs: list) -> list:
    import ray

    return ray.get(refs) if refs else []
