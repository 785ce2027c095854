"""The strategy of a node that trains with ``D`` device processes (docs/architecture.md:
Devices), without Ray: each process holds the rows of its device's keys (``(h(key) // N) % D``)
in its engine's table, steps through its slice of every global mini-batch with rows read from
the node's other devices, and sends each gradient row to the device that holds its key. Device
0 then puts the node's rows back together from every process's :class:`DevicePart`
(:func:`assemble`). The device mesh (``hpsray.cluster.mesh.DeviceMesh``) comes in as a
collaborator.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from hpsray.data.batch import Batch
from hpsray.tiers.loans import Loan, Refresh
from hpsray.tiers.partition import Routing, device_of, routing
from hpsray.training.engine import TrainerEngine, loaned_rows
from hpsray.training.exchange_plan import ExchangePlan
from hpsray.training.layout import MiniBatchIndex, index_batch, keys_as_tensor
from hpsray.training.marks import host_step, minibatch
from hpsray.training.part import DevicePart
from hpsray.training.strategies import BatchData, BatchResult, DenseReduce, KeepMasks, Strategy, Timed, no_clock

__all__ = ["DevicePart", "DeviceSteps", "Mesh", "assemble"]


class Mesh(Protocol):
    """What a device process needs of its mesh (``hpsray.cluster.mesh.DeviceMesh``)."""

    bytes_sent: int

    def allreduce_sum(self, flat: torch.Tensor) -> torch.Tensor: ...

    def lookup(self, keys: Any, rows_of: Callable[[Any], Any], routing: Routing | None = None) -> Any: ...

    def route(self, keys: Any, grads: Any, routing: Routing | None = None) -> tuple[Any, Any]: ...

    def allgather_sparse(self, keys: Any, grads: Any, counts: Sequence[int] | None = None) -> tuple[Any, Any]: ...


class DeviceSteps(Strategy):
    """Device ``device_index`` of ``n_devices`` on its node, over ``engine`` (whose table holds
    this device's rows) and ``mesh``; ``reduce`` sums the dense gradient over the mesh. Device 0
    gets the other devices' parts of a batch from ``peers()`` (the processes it started)."""

    def __init__(
        self,
        engine: TrainerEngine,
        n_devices: int,
        device_index: int,
        mesh: Mesh,
        reduce: DenseReduce,
        peers: Callable[[], list[DevicePart]] = list,
        timed: Timed = no_clock,
    ) -> None:
        super().__init__(engine, timed)
        self.n_devices, self.device_index, self.mesh = n_devices, device_index, mesh
        self.reduce, self.peers = reduce, peers
        self._sent = mesh.bytes_sent

    def peer_failed(self, batch_id: Hashable, error: BaseException | None) -> bool:
        failed = self.mesh.allreduce_sum(torch.tensor([0.0 if error is None else 1.0]))
        return error is None and float(failed[0]) > 0

    def run_batch(
        self, batch_id: Hashable, got: BatchData | BaseException, sizes: list[int], keep: KeepMasks
    ) -> BatchResult:
        """Device 0: this device's part of the batch, the others' (``peers``), put together."""
        data, devices, mine = self._part(batch_id, got, sizes, keep)
        theirs = self.peers()
        with self.timed(batch_id):
            returned, loss = assemble(data.keys, devices, [mine, *theirs], self.engine.row_width)
        self.engine.traffic.returned(batch_id, sum(k.size for k, _ in returned))
        examples = len(data.batch) if data.batch is not None else 0
        self.engine.examples += examples
        self.engine.losses[batch_id] = loss
        return BatchResult(returned, loss, examples)

    def run_part(
        self, batch_id: Hashable, got: BatchData | BaseException, sizes: list[int], keep: KeepMasks
    ) -> DevicePart:
        """Devices 1 .. D-1: this device's part of the batch."""
        return self._part(batch_id, got, sizes, keep)[2]

    def _part(
        self, batch_id: Hashable, got: BatchData | BaseException, sizes: list[int], keep: KeepMasks
    ) -> tuple[BatchData, list[np.ndarray], DevicePart]:
        """Borrow this device's rows of the node's loan, step through the batch's global
        mini-batches on this device's slice of each, and give back this device's rows of each
        owner's keys: the inputs, each owner's keys' devices, and this device's part."""
        data = self.resolved(batch_id, got)
        with self.timed(batch_id):
            with host_step("batch start"):
                devices = self.borrow(batch_id, data.keys, data.loans, data.refreshed)
            shares, scales = self.train(data.batch, sizes or [len(data.batch) if data.batch is not None else 0])
        kept = keep(data.keys)  # may wait for the next batch's read
        with self.timed(batch_id), host_step("batch end"):
            rows, back = self.end_batch(data.keys, devices, kept)
        return data, devices, DevicePart(rows, shares, scales, back)

    def borrow(
        self, batch_id: Any, key_parts: list[np.ndarray], loans: list[Loan], refreshed: list[Refresh]
    ) -> list[np.ndarray]:
        """Take this device's rows of the node's loans into the working set; returns each owner's
        keys' devices."""
        engine = self.engine
        n_nodes, d = engine.n_nodes, self.device_index
        devices = [device_of(k, n_nodes, self.n_devices) for k in key_parts]
        keys = np.concatenate(key_parts) if key_parts else np.empty(0, np.uint64)
        rows, held = loaned_rows(loans, key_parts, engine.row_width)
        mine = np.concatenate(devices) == d if devices else np.empty(0, bool)
        fresh = []
        for r in refreshed:
            m = device_of(r.keys, n_nodes, self.n_devices) == d
            fresh.append((r.keys[m], r.rows[m]))
        if held is None:
            engine.hbm.borrow(keys[mine], rows[mine], fresh)
        else:  # the rows shipped are those of the keys not held
            engine.hbm.borrow(keys[mine], rows[mine[~held]], fresh, held[mine])
        engine.set_resident(keys[mine])  # the updates of a step find this device's rows
        if d == 0:
            engine.traffic.received(batch_id, loans)
        return devices

    def train(self, batch: Batch | None, sizes: list[int]) -> tuple[list[float], list[float]]:
        """BSP over the mesh: per global mini-batch this device takes its contiguous slice of
        the node's part, reads the slice's rows from the devices that hold them, steps (the
        dense gradient summed by ``reduce``), sends the gradients to those devices, which apply
        every node's (paper App. C.3); ``sent`` gets each step's payload. Returns this device's
        loss share of each global mini-batch and the factor that makes the node's shares the
        node's mean loss (0 where the node's part is empty).

        The slices are indexed once per batch (:func:`~hpsray.training.layout.index_batch`
        over each slice's distinct keys), and so is where the updates go: every device's slices
        are known here, so the keys routed to this device per global mini-batch are too, and one
        :class:`~hpsray.training.exchange_plan.ExchangePlan` per batch (its all-gathers among the
        same device of every node) maps them to their rows. A step is then the engine's torch
        ops on the rows the mesh brings and on the gradients it routes here."""
        engine, mesh, reduce, sent = self.engine, self.mesh, self.reduce, self.sent
        engine.dense.train(True)
        d, n_dev, m = self.device_index, self.n_devices, engine.config.minibatch_size
        n = len(batch) if batch is not None else 0
        dim, dev = engine.grad_dim, engine.device
        with host_step("batch start"):  # the slices indexed, the exchange planned
            parts, routed = [], []
            n_mb = max((-(-s // m) for s in sizes), default=0)
            for k in range(n_mb):
                total = sum(min(max(s - k * m, 0), m) for s in sizes)
                size = max(min(m, n - k * m), 0)
                bounds = np.linspace(0, size, n_dev + 1).astype(int)
                slices = [
                    batch.slice(k * m + a, k * m + b) if batch is not None and b > a else None
                    for a, b in zip(bounds[:-1], bounds[1:])
                ]
                index, keys = self._index(slices[d])
                # every device's slice (in device order) and which of its keys live here: where this
                # device's keys go and how many come here are known now, for the whole batch
                here = [np.unique(p.keys) if p is not None else np.empty(0, np.uint64) for p in slices]
                here = [u[device_of(u, engine.n_nodes, n_dev) == d] for u in here]
                way = routing(keys, [u.size for u in here], engine.n_nodes, n_dev)
                way = Routing(dev.array(way.order), way.counts, way.got)
                parts.append((index, dev.array(keys), total, size, way))  # to the device once per batch
                routed.append(keys_as_tensor(np.concatenate(here), dev.torch))
            plan = ExchangePlan.of(engine, routed, n_mb, mesh)
        shares, scales = [], []
        for k, (index, keys, total, size, way) in enumerate(parts):
            with minibatch():
                rows = dev.tensor(mesh.lookup(keys, lambda k: engine.resident_rows(k, dim), way))
                if index is not None:
                    loss, row_grads = engine.backward_from(rows, index, total)
                    grads = dev.from_tensor(row_grads)
                else:
                    engine.dense.zero_grad()
                    loss = torch.zeros((), device=dev.torch)
                    grads = dev.xp.zeros((0, dim), dtype=dev.xp.float32)
                engine.dense.step_optimizers(reduce)
                got_keys, got_grads = mesh.route(keys, grads, way)  # the node's update of this device's rows
                _, got_grads = mesh.allgather_sparse(got_keys, got_grads, plan.counts(k))  # and every other node's
                engine.step += 1
                plan.apply(k, dev.tensor(got_grads), engine.step)
                sent.append(mesh.bytes_sent - self._sent)
                self._sent = mesh.bytes_sent
                shares.append(loss)
                scales.append(total / size if size else 0.0)
        with host_step("loss"):
            values = torch.stack(shares).cpu().tolist() if shares else []  # one read per batch
        return values, scales

    def _index(self, part: Batch | None) -> tuple[MiniBatchIndex | None, np.ndarray]:
        """A slice as one mini-batch indexed over its distinct keys (rows come from the mesh in
        their order), and those keys, sorted (none for an empty slice)."""
        if part is None or len(part) == 0:
            return None, np.empty(0, np.uint64)
        distinct = np.unique(part.keys)
        device = self.engine.device.torch

        def positions(keys: np.ndarray, on_device: torch.Tensor | None) -> torch.Tensor:
            return torch.from_numpy(np.searchsorted(distinct, keys)).to(device)

        index = index_batch(part, len(part), positions, distinct.size, device, with_keys=False)
        return index.minibatches[0], distinct

    def end_batch(
        self, key_parts: list[np.ndarray], devices: list[np.ndarray], keep: list[np.ndarray] | None
    ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """At the batch's end: this device's rows of each owner's keys that leave (``keep``:
        which stay, per owner), and which of each owner's keys leave (``None``: all)."""
        engine = self.engine
        here = [dv == self.device_index for dv in devices]
        engine.kept = [k[h & m] for k, h, m in zip(key_parts, here, keep, strict=True)] if keep else []
        back: list[np.ndarray | None] = [~m for m in keep] if keep is not None else [None] * len(key_parts)
        rows = [engine.rows(k[h if b is None else h & b]) for k, h, b in zip(key_parts, here, back, strict=True)]
        return rows, back


def assemble(
    key_parts: list[np.ndarray], devices: list[np.ndarray], parts: list[DevicePart], width: int
) -> tuple[list[tuple[np.ndarray, np.ndarray]], float]:
    """The node's rows going back, per owner ``(keys, rows)``, from every device's part (device
    order; ``devices[o]``: the device of each of owner ``o``'s keys), and the batch's mean loss."""
    mine, out = parts[0], []
    for o, (keys, where) in enumerate(zip(key_parts, devices, strict=True)):
        back = mine.returned[o]
        keys, where = (keys, where) if back is None else (keys[back], where[back])
        rows = np.empty((keys.size, width), dtype=np.float32)
        for d, part in enumerate(parts):
            rows[where == d] = part.rows[o]
        out.append((keys, rows))
    shares = np.sum([p.losses for p in parts], axis=0) if mine.losses else np.empty(0)
    losses = [float(x) * scale for x, scale in zip(shares, mine.scales, strict=True) if scale]
    return out, float(np.mean(losses)) if losses else float("nan")


def join_kept(
    engine: TrainerEngine, theirs: list[list[tuple[np.ndarray, np.ndarray]]]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per owner, the rows kept at the last batch's end by this device (``engine.flush()``) and by
    the node's other devices (``theirs[d][o]``: ``(keys, rows)``), put together; counts the
    others' in the engine's traffic."""
    out = []
    for o, (keys, rows) in enumerate(engine.flush()):
        parts = [(keys, rows), *(t[o] for t in theirs)]
        engine.traffic.flushed += sum(p[0].size for p in parts[1:])
        out.append((np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
    return out
