"""One device process's share of its node's batch when a node trains with ``D`` processes
(docs/architecture.md: Devices), without Ray: the process holds the rows of its device's keys
(``(h(key) // N) % D``) in its engine's table, steps through its slice of every global
mini-batch with rows read from the node's other devices, and sends each gradient row to the
device that holds its key. The device mesh (``hpsray.cluster.mesh.DeviceMesh``) comes in as a
collaborator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from hpsray.data.batch import Batch
from hpsray.tiers.loans import Loan, Refresh
from hpsray.tiers.partition import device_of
from hpsray.training.engine import TrainerEngine, loaned_rows
from hpsray.training.layout import MiniBatchIndex, index_batch

__all__ = ["DeviceShare", "Mesh"]


class Mesh(Protocol):
    """What a device process needs of its mesh (``hpsray.cluster.mesh.DeviceMesh``)."""

    bytes_sent: int

    def lookup(self, keys: Any, rows_of: Callable[[Any], Any]) -> Any: ...

    def route(self, keys: Any, grads: Any) -> tuple[Any, Any]: ...

    def allgather_sparse(self, keys: Any, grads: Any) -> tuple[Any, Any]: ...


class DeviceShare:
    """Device ``device_index`` of ``n_devices`` on its node, over ``engine`` (whose table holds
    this device's rows) and ``mesh``."""

    def __init__(self, engine: TrainerEngine, n_devices: int, device_index: int, mesh: Mesh) -> None:
        self.engine, self.n_devices, self.device_index, self.mesh = engine, n_devices, device_index, mesh
        self._empty = Batch.empty(engine.n_slots, engine.n_dense)
        self._sent = mesh.bytes_sent

    def borrow(
        self, batch_id: Any, key_parts: list[np.ndarray], loans: list[Loan], refreshed: list[Refresh]
    ) -> list[np.ndarray]:
        """Take this device's rows of the node's loans into the working set; returns each owner's
        keys' devices."""
        engine = self.engine
        n_nodes, d = engine.n_nodes, self.device_index
        devices = [device_of(k, n_nodes, self.n_devices) for k in key_parts]
        keys = np.concatenate(key_parts) if key_parts else np.empty(0, np.uint64)
        rows, held = loaned_rows(loans, key_parts, engine.config.row_width)
        mine = np.concatenate(devices) == d if devices else np.empty(0, bool)
        fresh = []
        for r in refreshed:
            m = device_of(r.keys, n_nodes, self.n_devices) == d
            fresh.append((r.keys[m], r.rows[m]))
        if held is None:
            engine.hbm.borrow(keys[mine], rows[mine], fresh)
        else:  # the rows shipped are those of the keys not held
            engine.hbm.borrow(keys[mine], rows[mine[~held]], fresh, held[mine])
        engine.hold(keys[mine])  # the updates of a step find this device's rows
        if d == 0:
            engine.traffic.received(batch_id, loans)
        return devices

    def train(
        self, batch: Batch | None, sizes: list[int], reduce: Callable[[torch.Tensor], torch.Tensor], sent: list[int]
    ) -> tuple[list[float], list[float]]:
        """BSP over the mesh: per global mini-batch this device takes its contiguous slice of
        the node's part, reads the slice's rows from the devices that hold them, steps (the
        dense gradient summed by ``reduce``), sends the gradients to those devices, which apply
        every node's (paper App. C.3); ``sent`` gets each step's payload. Returns this device's
        loss share of each global mini-batch and the factor that makes the node's shares the
        node's mean loss (0 where the node's part is empty).

        The slices are indexed once per batch (:func:`~hpsray.training.layout.index_batch`
        over each slice's distinct keys); a step is then the engine's torch ops on the rows the
        mesh brings, and the updates reach this device's rows through
        :meth:`~hpsray.training.engine.TrainerEngine.apply_updates`."""
        engine, mesh = self.engine, self.mesh
        engine.dense.train(True)
        d, n_dev, m = self.device_index, self.n_devices, engine.config.minibatch_size
        n = len(batch) if batch is not None else 0
        dim, dev = engine.config.dim, engine.device
        parts = []
        for k in range(max((-(-s // m) for s in sizes), default=0)):
            total = sum(min(max(s - k * m, 0), m) for s in sizes)
            size = max(min(m, n - k * m), 0)
            lo, hi = np.linspace(0, size, n_dev + 1).astype(int)[d : d + 2]
            part = batch.slice(k * m + lo, k * m + hi) if batch is not None and hi > lo else None
            parts.append((self._index(part), total, size))
        shares, scales = [], []
        for (index, keys), total, size in parts:
            rows = dev.tensor(mesh.lookup(dev.array(keys), lambda k: engine.hbm.get(k, columns=dim)))
            if index is not None:
                loss, row_grads = engine.backward_from(rows, index, total)
                grads = dev.from_tensor(row_grads)
            else:
                engine.dense.zero_grad()
                loss = torch.zeros((), device=dev.torch)
                grads = dev.xp.zeros((0, dim), dtype=dev.xp.float32)
            engine.dense.step_optimizers(reduce)
            got_keys, got_grads = mesh.route(dev.array(keys), grads)  # the node's update of this device's rows
            got_keys, got_grads = mesh.allgather_sparse(got_keys, got_grads)  # and every other node's
            engine.step += 1
            engine.apply_updates(got_keys, got_grads)
            sent.append(mesh.bytes_sent - self._sent)
            self._sent = mesh.bytes_sent
            shares.append(loss)
            scales.append(total / size if size else 0.0)
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

    def give_back(
        self, key_parts: list[np.ndarray], devices: list[np.ndarray], keep: list[np.ndarray] | None
    ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """At the batch's end: this device's rows of each owner's keys that leave (``keep``:
        which stay, per owner), and which of each owner's keys leave (``None``: all)."""
        engine = self.engine
        here = [dv == self.device_index for dv in devices]
        engine.unreturned = [k[h & m] for k, h, m in zip(key_parts, here, keep, strict=True)] if keep else []
        back: list[np.ndarray | None] = [~m for m in keep] if keep is not None else [None] * len(key_parts)
        rows = [engine.rows(k[h if b is None else h & b]) for k, h, b in zip(key_parts, here, back, strict=True)]
        return rows, back
