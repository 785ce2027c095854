"""``Trainer``: a node's HBM-PS working set and its dense model replicas, training batches."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpsray.actors.livemetrics import LiveGauges
from hpsray.actors.messages import Returned, TrainInputs, TrainOutcome
from hpsray.actors.timing import StageClock
from hpsray.actors.working_set import Traffic, kept_masks, loaned_rows
from hpsray.cluster.consistency import CarryOver, crosses_batches, merge_payloads
from hpsray.cluster.mesh import DeviceMesh, rendezvous_address
from hpsray.config import TrainConfig
from hpsray.data.batch import Batch
from hpsray.errors import PeerFailedError
from hpsray.kernels.arrays import to_host
from hpsray.kernels.fused import LookupProbe
from hpsray.models.device import StepDevice
from hpsray.models.dnn import DNN
from hpsray.models.pooling import BagLayout, pool_sum
from hpsray.models.step import DenseReplicas
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.partition import device_of
from hpsray.tiers.warmup import warm_trainer_step


@dataclass(frozen=True)
class DevicePart:
    """One device process's result of a batch: its rows of each owner's keys going back (in the
    keys' order, only those it holds) and its loss share of each global mini-batch, with the
    factor that turns the node's summed shares into its mean loss (0: the node's part was empty)."""

    rows: list[np.ndarray]
    losses: list[float]
    scales: list[float]
    returned: list[np.ndarray | None]  # per owner, which of its keys go back (None: all)


class Trainer:
    """Trains each batch on its working set (paper Algorithm 1, step 4).

    Args:
        node, n_nodes: this node and how many there are (for the device hash).
        config: model shape, optimizers, mini-batch size, seed.
        n_slots, n_dense: input shape.
        capacity: rows the working set of two consecutive batches may hold.
        n_devices: ``D``: the node trains with ``D`` processes, one per device (one GPU each
            on CUDA), each holding the keys of its device and a dense replica. This actor is
            device 0, the node's trainer the pipeline calls; it starts the other ``D - 1``
            (``device_index`` 1 .. D-1) and they meet in a :class:`DeviceMesh` (``join``).
        device: where the whole step runs: ``"cpu"`` (numba tables, torch on CPU) or ``"cuda"``
            (numba.cuda tables, CuPy key work and torch on this process's GPU; Ray gives the
            actor its own GPU with ``num_gpus=1``). Per mini-batch only the keys, dense
            features and labels go to the GPU; the loss is read once per batch.
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
        self.optimizer = config.optimizer()
        self.device = StepDevice(device)
        # with D devices, this process holds one device's share of the node's working set
        self._capacity = capacity if n_devices == 1 else int(np.ceil(capacity / n_devices * 1.25)) + 64
        self.hbm = HbmPS(self._capacity, config.row_width, config.row_init(), 1, n_nodes, device)
        self.workers: list = []  # device 0 (the node's trainer) starts the node's other D - 1
        if n_devices > 1 and device_index == 0:  # before the model moves to this device
            args = (node, n_nodes, config, n_slots, n_dense, capacity, n_devices, device, model, threads)
            self.workers = _start_device_workers(args, placement, name)
        self.mesh: DeviceMesh | None = None  # with D > 1 devices (see join)
        model = model if model is not None else DNN(n_slots, config.dim, n_dense, config.hidden, seed=config.seed)
        self.dense = DenseReplicas(model, 1, config.dense_optimizer, config.dense_lr, self.device)
        self.n_nodes = n_nodes
        self.group = None  # the collective group, when n_nodes > 1 (see join)
        self.dense_reducer = None
        self._chunked = False  # the device mesh sums dense gradients per node, then in chunks (join_mesh)
        self._clock_base = 0  # the step every trainer of the group started from (_restart_clocks)
        self._mailbox = None
        self.sync, self.board, self.exchange = None, None, None  # relaxed modes: how updates propagate (see join)
        self.max_staleness = 0
        self._seen = {r: 0 for r in range(n_nodes) if r != node}  # newest clock applied per other trainer
        self._pending_dense = None
        self.exchanged_bytes: list[int] = []  # per global mini-batch, this node's payload
        self._sent = 0
        self._empty = Batch.empty(n_slots, n_dense)
        self.step = 0
        self.examples = 0
        self.traffic = Traffic(config.row_width * 4)
        self._unreturned: list[np.ndarray] = []  # per owner: keys kept at the last batch's end, not returned
        self.losses: dict = {}
        self.clock = StageClock("train", node)
        self.gauges = LiveGauges(stage="train", node=node)
        # numba (and on CUDA, CuPy and torch's kernels) compile here, before the pipeline's clock
        warm_trainer_step(
            HbmPS(256, config.row_width, config.row_init(), 1, n_nodes, device),
            self.dense,
            self.optimizer,
            config.dim,
            config.row_init(),
            config.row_width,
            n_slots,
            n_dense,
        )

    def __repr__(self) -> str:
        return f"Trainer[node {self.node}]" + (f"[device {self.device_index}]" if self.n_devices > 1 else "")

    def join(self, world: int, group: str, sync, aggregators=None, board=None, mesh_address: str | None = None) -> int:
        """Join the trainers' collective group (every trainer calls this at once); ``sync`` is
        the pipeline's :class:`~hpsray.pipelines.SyncStage`. Under a relaxed mode this also
        sets up how updates propagate (:mod:`hpsray.cluster.consistency`): push and pull start
        this trainer's mailbox and find the others'; relay uses ``board``. With ``D > 1``
        devices the node's device processes join the device mesh at ``mesh_address`` instead
        (:meth:`mesh_address` of node 0's trainer; BSP only)."""
        from hpsray.cluster.collective import CollectiveGroup

        if self.n_devices > 1:
            import ray

            chunked = sync.dense == "chunked" and world > 1  # device 0 of each node aggregates across nodes
            refs = [w.join_mesh.remote(mesh_address, world, chunked) for w in self.workers]
            self.join_mesh(mesh_address, world, chunked)
            ray.get(refs)
            self.sync = sync
            if chunked:
                from hpsray.cluster.aggregation import ChunkedAggregator

                self.dense_reducer = ChunkedAggregator(aggregators, world, self.node, chunk_bytes=sync.chunk_bytes)
            return self.node
        backend = "nccl" if self.hbm.device == "cuda" else "gloo"
        self.group = CollectiveGroup(world, self.node, group, backend)
        self.sync, self.board = sync, board
        self.exchange = None
        if sync.consistency != "bsp":
            from hpsray.cluster import consistency

            propagation = getattr(sync, "propagation", "relay")
            boxes = None
            if propagation != "relay":
                self._mailbox = consistency.start_mailbox(group, world, self.node)
                boxes = consistency.find_mailboxes(group, world)
            self.exchange = consistency.make_exchange(propagation, self.node, world, board, boxes)
            self._seen = {r: 0 for r in range(world) if r != self.node}
            self._restart_clocks()
        if sync.dense == "chunked":
            from hpsray.cluster.aggregation import ChunkedAggregator

            self.dense_reducer = ChunkedAggregator(aggregators, world, self.node, chunk_bytes=sync.chunk_bytes)
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
        if self.dense_reducer is not None:
            out = self.dense_reducer.reduce(flat, self.step)
            self.group.bytes_sent += flat.numel() * flat.element_size()
            return out
        return self.group.allreduce_sum(flat)

    def train(self, batch_id, inputs: TrainInputs) -> tuple:
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
        import ray

        error = None
        try:
            batch, key_parts, loans, refreshed = inputs.unpack(ray.get(inputs.refs()))
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the peers
            error = e
        if self.n_nodes > 1 and self.group is not None and self._peer_failed(batch_id, error):
            raise PeerFailedError(batch_id)  # "batch N failed on another node; see that trainer's error"
        if error is not None:
            raise error
        with self.clock.timed(batch_id):
            keys = key_parts[0] if len(key_parts) == 1 else np.concatenate(key_parts)
            rows, held = loaned_rows(loans, key_parts, self.config.row_width)
            self.hbm.borrow(keys, rows, [(r.keys, r.rows) for r in refreshed], held)
            self.traffic.received(batch_id, loans)
            if self.n_nodes == 1:
                losses = self._train_local(batch)
            elif self.exchange is None:
                losses = self._train_steps(batch, inputs.sizes)
            else:
                losses = self._train_stale(batch, inputs.sizes)
            self.examples += len(batch) if batch is not None else 0
            # the losses stay on the device until here: one read per batch
            self.losses[batch_id] = float(torch.stack(losses).sum()) / len(losses) if losses else float("nan")
        keep = kept_masks(inputs.next_batch, key_parts) if self.n_nodes == 1 else None  # waits for its read
        with self.clock.timed(batch_id):
            self._unreturned = [k[m] for k, m in zip(key_parts, keep, strict=True)] if keep is not None else []
            out = [self._returned(k if keep is None else k[~keep[o]]) for o, k in enumerate(key_parts)]
            self.traffic.returned(batch_id, sum(r.keys.size for r in out))
        done = len(batch) if batch is not None else 0
        self.gauges.set(loss=self.losses[batch_id], examples_per_s=done / max(self.clock.per_batch[batch_id], 1e-9))
        self.gauges.set_sync(self.max_staleness, self.exchanged_bytes)
        return (*out, TrainOutcome(self.losses[batch_id], done))

    def _weights(self, keys):
        return self.hbm.get(keys, columns=self.config.dim)

    # -- D devices: one process each (docs/architecture.md: Devices) -----------------------

    def _train_on_devices(self, batch_id, inputs: TrainInputs) -> tuple:
        """Device 0's :meth:`train` with ``D > 1``: every device process trains its part of the
        batch (:meth:`train_part`); this one then puts the node's rows back together, one
        :class:`Returned` per owner, and the batch's loss."""
        import ray

        parts = [w.train_part.remote(batch_id, inputs) for w in self.workers]
        try:
            batch, key_parts, devices, mine = self._device_part(batch_id, inputs)
            theirs = ray.get(parts)
        except Exception:
            if _a_worker_died(parts):  # restart this node's trainer: its workers die with it
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

    def train_part(self, batch_id, inputs: TrainInputs) -> DevicePart:
        """A device process's share of a batch (called by device 0 of its node)."""
        return self._device_part(batch_id, inputs)[3]

    def _device_part(self, batch_id, inputs: TrainInputs) -> tuple[Any, list, list, DevicePart]:
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
            batch, key_parts, loans, refreshed = inputs.unpack(ray.get(inputs.refs()))
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
            error = e
        failed = mesh.allreduce_sum(torch.tensor([0.0 if error is None else 1.0]))
        if error is not None:
            raise error
        if float(failed[0]) > 0:
            raise PeerFailedError(batch_id)
        with self.clock.timed(batch_id):
            devices = [device_of(k, self.n_nodes, self.n_devices) for k in key_parts]
            keys = np.concatenate(key_parts) if key_parts else np.empty(0, np.uint64)
            rows, held = loaned_rows(loans, key_parts, self.config.row_width)
            mine = np.concatenate(devices) == self.device_index if devices else np.empty(0, bool)
            fresh = []
            for r in refreshed:
                m = device_of(r.keys, self.n_nodes, self.n_devices) == self.device_index
                fresh.append((r.keys[m], r.rows[m]))
            if held is None:
                self.hbm.borrow(keys[mine], rows[mine], fresh)
            else:  # the rows shipped are those of the keys not held
                self.hbm.borrow(keys[mine], rows[mine[~held]], fresh, held[mine])
            if self.device_index == 0:
                self.traffic.received(batch_id, loans)
            sizes = inputs.sizes or [len(batch) if batch is not None else 0]
            shares, scales = self._device_steps(batch, sizes)
        keep = kept_masks(inputs.next_batch, key_parts) if self.n_nodes == 1 else None  # waits for its read
        with self.clock.timed(batch_id):
            here = [d == self.device_index for d in devices]
            self._unreturned = [k[h & m] for k, h, m in zip(key_parts, here, keep, strict=True)] if keep else []
            back = [None if keep is None else ~m for m in keep or key_parts]
            rows_back = [self.hbm.get(k[h if b is None else h & b]) for k, h, b in zip(key_parts, here, back)]
        return batch, key_parts, devices, DevicePart(rows_back, shares, scales, back)

    def _device_steps(self, batch, sizes: list[int]) -> tuple[list[float], list[float]]:
        """BSP over the mesh: per global mini-batch this device takes its contiguous slice of
        the node's part, reads the slice's rows from the devices that hold them, steps, sends
        the gradients to those devices, which apply every node's (paper App. C.3). Returns this
        device's loss share of each global mini-batch and the factor that makes the node's
        shares the node's mean loss (0 where the node's part is empty)."""
        mesh = self.mesh
        assert mesh is not None
        self.dense.train(True)
        d, n_dev = self.device_index, self.n_devices
        shares, scales = [], []
        for mb, total in self._global_minibatches(batch, sizes):
            lo, hi = np.linspace(0, len(mb), n_dev + 1).astype(int)[d : d + 2]
            part = mb.slice(lo, hi) if hi > lo else self._empty
            loss, gkeys, grads = self.dense.step(part, self._weights_on_mesh, total=total, reduce=self._reduce_on_mesh)
            keys, grads = mesh.route(gkeys, grads)  # the node's update of this device's rows
            keys, grads = mesh.allgather_sparse(keys, grads)  # and every other node's
            self.step += 1
            self.hbm.apply_gradients(keys, grads, self.optimizer, self.step, resident_only=self.n_nodes > 1)
            self.exchanged_bytes.append(mesh.bytes_sent - self._sent)
            self._sent = mesh.bytes_sent
            shares.append(loss)
            scales.append(total / len(mb) if len(mb) else 0.0)
        values = torch.stack(shares).cpu().tolist() if shares else []  # one read per batch
        return values, scales

    def _weights_on_mesh(self, keys):
        """The step's ``weights_of`` with ``D`` devices: rows from the devices that hold them."""
        if isinstance(keys, LookupProbe):  # no fused path across processes
            return None
        assert self.mesh is not None
        return self.device.array(self.mesh.lookup(keys, self._weights))

    def _train_local(self, batch) -> list[torch.Tensor]:
        self.dense.train(True)
        losses = []
        for mb in batch.minibatches(self.config.minibatch_size):
            loss, gkeys, grads = self.dense.step(mb, self._weights)
            self.step += 1
            self.hbm.apply_gradients(gkeys, grads, self.optimizer, self.step)
            losses.append(loss)
        return losses

    def _train_steps(self, batch, sizes: list[int]) -> list[torch.Tensor]:
        """BSP across nodes: after every global mini-batch, all trainers combine their sparse
        updates (each applies every node's to the rows it holds) and sum their dense gradients."""
        self.dense.train(True)
        losses = []
        for mb, total in self._global_minibatches(batch, sizes):
            self._straggle(self.step + 1)
            loss, gkeys, grads = self.dense.step(mb, self._weights, total=total, reduce=self._reduce_dense)
            all_keys, all_grads = self.group.allgather_sparse(gkeys, grads)
            self.step += 1
            self.hbm.apply_gradients(all_keys, all_grads, self.optimizer, self.step, resident_only=True)
            self.exchanged_bytes.append(self.group.bytes_sent - self._sent)
            self._sent = self.group.bytes_sent
            if len(mb):
                losses.append(loss * total / len(mb))
        return losses

    def _global_minibatches(self, batch, sizes: list[int]):
        """This node's part of each global mini-batch of the batch (empty once its examples are
        used up), with the global mini-batch's size: every node steps through as many as the
        node with the most examples."""
        m = self.config.minibatch_size
        n = len(batch) if batch is not None else 0
        for k in range(max(-(-s // m) for s in sizes)):
            total = sum(min(max(s - k * m, 0), m) for s in sizes)
            yield (batch.slice(k * m, min((k + 1) * m, n)) if k * m < n else self._empty), total

    def _straggle(self, clock: int) -> None:
        """``SyncStage(straggler_delay_s=...)``: the trainer of ``straggler_node`` sleeps before
        mini-batch ``clock`` for a seeded delay, ``delay * U(0, 2)`` with probability
        ``straggler_probability`` (the same delays in every mode, for experiments)."""
        sync = self.sync
        delay = getattr(sync, "straggler_delay_s", 0.0) if sync is not None else 0.0
        if not delay or self.node != sync.straggler_node:
            return
        rng = np.random.default_rng([sync.straggler_seed, self.node, clock])
        if rng.random() < sync.straggler_probability:
            time.sleep(delay * rng.uniform(0.0, 2.0))

    _carry: CarryOver | None = None  # SSP/ASP across batch ends (see _train_stale)

    def _train_stale(self, batch, sizes: list[int]) -> list[torch.Tensor]:
        """SSP, A-BSP and ASP across nodes (:mod:`hpsray.cluster.consistency`): publish each
        mini-batch's update (A-BSP: each clock's ``k``), apply the others' as they arrive, wait
        only when beyond the slack: ``staleness`` for the embeddings, ``dense_staleness`` (when
        given) for the dense parameters.

        A-BSP ends each batch with a barrier. SSP and ASP do not (docs/architecture.md:
        Consistency): the clock runs on, the batch end waits only as the bound requires for the
        next clock, and the rows borrowed anew first get the others' updates of the batch before
        (:class:`~hpsray.cluster.consistency.CarryOver`); :meth:`settle` ends a pass."""
        self.dense.train(True)
        sync = self.sync
        mode = sync.consistency
        k = max(1, getattr(sync, "work_per_clock", 1)) if mode == "absp" else 1
        bound = sync.staleness if mode == "ssp" else (k - 1 if mode == "absp" else None)
        dense_bound = getattr(sync, "dense_staleness", None)
        hook = sync.before_minibatch  # an injection point for tests (a straggler); None otherwise
        carry = self._carry_over()
        if carry is not None:
            self._replay(carry)
        steps = list(self._global_minibatches(batch, sizes))
        losses = []
        out_keys, out_grads, out_dense = [], [], None  # own updates of the clock not published yet
        for i, (mb, total) in enumerate(steps):
            clock = self.step + 1
            if mode != "absp":
                # ssp: every other trainer's update of clock - 1 - s must be in; asp: take what is there
                others = self._fetch(clock - 1 - bound if bound is not None else -1, upto=clock - 1)
            elif i % k == 0 and i > 0:  # A-BSP: a clock's start is a barrier
                others = self._fetch(clock - 1, upto=clock - 1)
            else:
                others = self._no_update()
            self._apply_others(others)  # fetched updates reach the rows before this mini-batch reads them
            oldest = min(self._seen.values())
            self.max_staleness = max(self.max_staleness, clock - 1 - oldest)
            if carry is not None and oldest < carry.first - 1:  # another trainer is in an earlier batch
                carry.max_across = max(carry.max_across, clock - 1 - oldest)
            self._straggle(clock)
            if hook is not None:
                hook(self.node, clock)
            own: dict = {}

            def reduce(flat: torch.Tensor, own=own, others=others, clock=clock) -> torch.Tensor:  # via the host
                own["dense"] = flat.detach().cpu().numpy().copy()
                if dense_bound is None:  # the dense gradient travels with the sparse update
                    return flat + self.device.tensor(others["dense"]) if others["dense"] is not None else flat
                return self.device.tensor(self._dense_with_slack(own["dense"], clock, dense_bound))

            loss, gkeys, grads = self.dense.step(mb, self._weights, total=total, reduce=reduce)
            gkeys, grads = to_host(gkeys), to_host(grads)
            self.step += 1
            self.hbm.apply_gradients(gkeys, grads, self.optimizer, self.step, resident_only=True)
            out_keys.append(gkeys)
            out_grads.append(grads)
            if dense_bound is None:
                out_dense = own["dense"] if out_dense is None else out_dense + own["dense"]
            if (i + 1) % k == 0 or i + 1 == len(steps):
                if len(out_keys) == 1:
                    payload = (out_keys[0], out_grads[0], out_dense)
                else:  # A-BSP: the clock's k updates as one
                    merged = merge_payloads([(kk, gg, None) for kk, gg in zip(out_keys, out_grads, strict=True)])
                    payload = (merged[0], merged[1], out_dense)
                self.exchange.publish("all", clock, payload)
                out_keys, out_grads, out_dense = [], [], None
            self.exchanged_bytes.append(self.exchange.received_bytes - self._sent)
            self._sent = self.exchange.received_bytes
            if len(mb):
                losses.append(loss * total / len(mb))
        if carry is None:  # A-BSP: the batch end is a barrier, every update in before write-back
            self._batch_end(self.step)
        else:  # SSP/ASP: wait only as the next clock's bound requires; take what else has arrived
            self._batch_end(self.step - bound if bound is not None else -1)
            oldest = min(self._seen.values())
            carry.max_return = max(carry.max_return, self.step - oldest)
            carry.batch_end(self.step, self._resident())
            carry.parts = []
        return losses

    def _carry_over(self) -> CarryOver | None:
        """The state across batch ends under SSP/ASP (``None`` under A-BSP: batch ends are barriers)."""
        if not crosses_batches(self.sync):
            return None
        if self._carry is None or self.step < self._carry.last:  # first batch, or restored from a checkpoint
            self._carry = CarryOver()
            self._carry.batch_end(self.step, self._resident())
            self._carry.base = self.step
        return self._carry

    def _resident(self) -> np.ndarray:
        keys = [to_host(t.keys()) for t in self.hbm.tables]
        return np.sort(np.concatenate(keys)) if keys else np.empty(0, np.uint64)

    def _replay(self, carry: CarryOver) -> None:
        """A batch start under SSP/ASP: the rows borrowed anew were lent before the last batch's
        write-back; give them the others' updates of that batch received so far (later ones
        arrive through :meth:`_fetch` and reach every resident row)."""
        keys, grads = carry.replay(self._resident())
        if keys.size:
            self.hbm.apply_gradients(keys, grads, self.optimizer, self.step, resident_only=True)

    def _apply_others(self, others: dict) -> None:
        if others["keys"].size:
            self.hbm.apply_gradients(others["keys"], others["grads"], self.optimizer, self.step, resident_only=True)

    def _batch_end(self, oldest: int) -> None:
        """Fetch the others' updates up to this trainer's clock, after waiting for their clock
        ``oldest``, and apply them (the dense part waits for the next step)."""
        rest = self._fetch(oldest, upto=self.step)
        self._apply_others(rest)
        if rest["dense"] is not None:
            self._pending_dense = rest["dense"]
        if self.exchanged_bytes:
            self.exchanged_bytes[-1] += self.exchange.received_bytes - self._sent
            self._sent = self.exchange.received_bytes

    def _returned(self, keys: np.ndarray) -> Returned:
        """This trainer's rows of ``keys`` for their owner; under SSP/ASP stamped with its clock
        and the oldest clock of the others it holds (the owner keeps the freshest copy)."""
        carry = self._carry if crosses_batches(self.sync) else None
        if carry is None:
            return Returned(self.node, keys, self.hbm.get(keys))
        carry.parts.append(keys)
        return Returned(self.node, keys, self.hbm.get(keys), self.step, min(self._seen.values()))

    def flush(self) -> list[Returned]:
        """The rows this node kept at the last batch's end instead of returning them, one
        :class:`Returned` per owner (empty when it kept none), for
        ``MemPSShard.store_kept``: before a checkpoint, at a stop, after a failure. The rows
        stay resident; the next batch's end returns or keeps them as usual."""
        theirs = _get([w.flush.remote() for w in self.workers])
        kept, self._unreturned = self._unreturned, []
        out = []
        for o, keys in enumerate(kept):
            parts = [(keys, self.hbm.get(keys)), *((t[o].keys, t[o].rows) for t in theirs)]
            ks, rows = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
            out.append(Returned(self.node, ks, rows))
        self.traffic.flushed += sum(r.keys.size for r in out)
        return out

    def settle(self, batch_id) -> tuple:
        """The final barrier of a pass under SSP/ASP (the schedule calls it after the last
        batch's ``train``): wait for every other trainer's last clock, apply all their updates,
        and return the last batch's rows, complete, one :class:`Returned` per owner (call with
        ``.options(num_returns=n_nodes)``)."""
        carry = self._carry_over()
        assert carry is not None, "settle: only under ssp/asp"
        with self.clock.timed(batch_id):
            self._batch_end(self.step)
            parts = list(carry.parts)
            out = [Returned(self.node, k, self.hbm.get(k), self.step, None) for k in parts]
            carry.settled(self.step, self._resident())
        return tuple(out)

    def _peer_failed(self, batch_id, error: BaseException | None) -> bool:
        """Whether another node's trainer failed ``batch_id`` (its inputs). BSP and A-BSP agree
        on that in the collective, a barrier; under SSP/ASP a trainer that failed tells the
        others through the exchange instead (their waits raise :class:`PeerFailedError`)."""
        if crosses_batches(self.sync) and self.exchange is not None:
            if error is not None:
                self.exchange.fail(batch_id)
            return False
        failed = self.group.allreduce_sum(torch.tensor([0.0 if error is None else 1.0]))
        return error is None and float(failed[0]) > 0

    def _no_update(self) -> dict:
        return {"keys": np.empty(0, np.uint64), "grads": np.empty((0, self.config.dim), np.float32), "dense": None}

    def _dense_with_slack(self, mine: np.ndarray, clock: int, slack: int) -> np.ndarray:
        """The dense gradient to step with at ``clock`` when the dense parameters have their own
        slack: this trainer's and the others' versions up to ``clock`` it has not used, after
        waiting for everyone's version ``clock - slack``, summed in (clock, rank) order. With
        slack 0 that is every trainer's gradient of ``clock`` in rank order: the same sum, so
        the same dense weights, on every node."""
        self.exchange.publish("dense", clock, (None, None, mine))
        got = self.exchange.fetch("dense", self._since_start(clock - slack), clock, self._seen_dense)
        for rank, c, _ in got:
            self._seen_dense[rank] = max(self._seen_dense[rank], c)
        parts = sorted([(self.node, clock, mine), *((r, c, p[2]) for r, c, p in got)], key=lambda u: (u[1], u[0]))
        total = parts[0][2].copy()
        for _, _, d in parts[1:]:
            total = total + d
        return total

    def _restart_clocks(self) -> None:
        """Every trainer of a (re)formed group starts from the same step (a fresh run's 0, or the
        checkpoint's after a restore): count the others as having published up to it, since
        their versions before it will never come (the new mailboxes are empty)."""
        self._clock_base = self.step
        self._seen = dict.fromkeys(self._seen, self.step)
        self._seen_dense = dict(self._seen)

    def _since_start(self, oldest: int) -> int:
        """``oldest`` to wait for, or 0 (wait for nothing) when it predates the group's start."""
        return oldest if oldest > self._clock_base else 0

    def _fetch(self, oldest: int, upto: int | None = None) -> dict:
        """The others' updates not applied yet (waiting for clock ``oldest``), combined."""
        got = self.exchange.fetch("all", self._since_start(oldest), upto, self._seen)
        keys, grads, dense = [np.empty(0, np.uint64)], [np.empty((0, self.config.dim), np.float32)], None
        if self._pending_dense is not None:
            dense, self._pending_dense = self._pending_dense, None
        carry = self._carry if crosses_batches(self.sync) else None
        for rank, clock, (k, g, d) in got:
            if k is not None and k.size:
                keys.append(k)
                grads.append(g)
                if carry is not None:
                    carry.record(clock, k, g)
            if d is not None:
                dense = d.copy() if dense is None else dense + d
            self._seen[rank] = max(self._seen[rank], clock)
        return {"keys": np.concatenate(keys), "grads": np.concatenate(grads), "dense": dense}

    @torch.no_grad()
    def predict(self, batch, keys: list, rows: list) -> np.ndarray:
        """Click probabilities of ``batch`` given, per owner node, refs of its keys and of their
        current rows."""
        import ray

        values = ray.get([*keys, *rows])
        keys, rows = np.concatenate(values[: len(keys)]), np.concatenate(values[len(keys) :])
        order = np.argsort(keys)
        keys, rows = keys[order], rows[order]
        model = self.dense.models[0]
        model.eval()
        out = []
        dim, dev = self.config.dim, self.device
        for mb in batch.minibatches(self.config.minibatch_size):
            layout = BagLayout.of(mb)
            emb = dev.tensor(np.ascontiguousarray(rows[np.searchsorted(keys, layout.unique_keys), :dim]))
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
        c = self.config
        refs = [w.reset.remote(path) for w in self.workers]
        self.hbm = HbmPS(self._capacity, c.row_width, c.row_init(), 1, self.n_nodes, self.hbm.device)
        self._unreturned = []
        self._seen = dict.fromkeys(self._seen, 0)
        self._pending_dense = None
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
        self._restart_clocks()
        return self.step

    def replicas_equal(self) -> bool:
        """Whether the dense replicas of every device process of this node are equal."""
        ref = self.dense_state()
        return all(
            torch.equal(ref[k], other[k]) for other in _get([w.dense_state.remote() for w in self.workers]) for k in ref
        )

    def stats(self) -> dict:
        sent = self.exchanged_bytes
        return {
            **self.clock.snapshot(),
            "examples": self.examples,
            "steps": self.step,
            "losses": dict(self.losses),
            "exchanged_bytes_per_step": float(np.mean(sent)) if sent else 0.0,
            "max_staleness": self.max_staleness,
            "max_staleness_across_batches": self._carry.max_across if self._carry is not None else 0,
            "max_return_staleness": self._carry.max_return if self._carry is not None else 0,
            "traffic": self.traffic.snapshot(),
        }


def _get(refs: list) -> list:
    import ray

    return ray.get(refs) if refs else []


def _start_device_workers(args: tuple, placement: Any, name: str | None) -> list:
    """The node's trainer processes for devices ``1 .. D-1`` (``args``: the trainer's own
    arguments), on this node: in bundle ``d`` of ``placement`` (a placement group of one GPU
    per bundle, on CUDA) or pinned to this node (on CPU). They are this actor's: they die with
    it, and a recovery that restarts it starts them again."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    workers = []
    for d in range(1, args[6]):
        opts = device_options(d, placement, here)
        if name:
            opts["name"] = f"{name[:-1]}, device {d}]" if name.endswith("]") else f"{name}[device {d}]"
        workers.append(ray.remote(Trainer).options(**opts).remote(*args, device_index=d))
    return workers


def device_options(d: int, placement: Any, node_id: str) -> dict[str, Any]:
    """Ray options of device ``d``'s trainer process: one GPU in bundle ``d`` of the node's
    placement group, or (on CPU, ``placement`` None) pinned to the node ``node_id``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1}
    if placement is not None:
        opts["num_gpus"] = 1
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=d)
    else:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return opts


def _a_worker_died(parts: list, timeout: float = 10.0) -> bool:
    """Whether one of the device processes behind ``parts`` (their train_part calls) is dead."""
    import ray

    ready, _ = ray.wait(parts, num_returns=len(parts), timeout=timeout) if parts else ([], [])
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            return True
        except Exception:  # noqa: BLE001,S112 - a failure of its own, not a death
            continue
    return False
