"""``MemPSShard``: a node's MEM-PS (host-memory cache over its SSD-PS) as a Ray actor."""

from __future__ import annotations

import numpy as np
import ray

from hpsray.kernels.init import RowInit, initial_rows
from hpsray.actors.timing import StageClock
from hpsray.tiers.mem import MemPS


class _RemoteStore:
    """The MEM-PS engine's backing store, served by the node's ``SSDPSShard`` actor."""

    def __init__(self, actor, width: int) -> None:
        self.actor, self.width = actor, width
        self.batch = None  # tags SSD time with the batch being pulled

    def load(self, keys):
        rows, found = ray.get(self.actor.load.remote(keys, self.batch))
        return np.array(rows), found  # object-store arrays are read-only; the engine fills misses in place

    def dump(self, keys, rows) -> None:
        ray.get(self.actor.dump.remote(keys, rows, self.batch))


class MemPSShard:
    """Pulls pin a batch's rows; write-backs store the trained rows and release the pins."""

    def __init__(self, node: int, ssd_actor, width: int, init: RowInit, capacity_rows: int | None = None,
                 capacity_bytes: int | None = None, **options) -> None:
        self.node = node
        self.init = init
        self.store = _RemoteStore(ssd_actor, width)
        self.mem = MemPS(capacity_rows, width, self.store, init, capacity_bytes=capacity_bytes, **options)
        self.clock = StageClock("pull", node)
        self.hit_rate: dict = {}

    def __repr__(self) -> str:
        return f"MemPS[node {self.node}]"

    def pull(self, batch_id, keys: np.ndarray) -> np.ndarray:
        """Rows of the batch's distinct ``keys``, pinned until its write-back."""
        with self.clock.timed(batch_id):
            self.store.batch = batch_id
            rows = self.mem.pull(batch_id, keys)
            self.hit_rate[batch_id] = self.mem.batch_stats(batch_id)["hit_rate"]
            return rows

    def write_back(self, batch_id, result: dict) -> int:
        """Store the trainer's updated rows of ``batch_id`` and unpin them."""
        with self.clock.timed(batch_id):
            self.store.batch = batch_id
            self.mem.write_back(batch_id, result["keys"], result["rows"])
            self.mem.unpin(batch_id)
            return int(result["keys"].size)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Current rows of ``keys`` for evaluation: resident, else stored, else initial; no pinning."""
        resident = self.mem.contains(keys)
        out = np.empty((keys.size, self.mem.width), dtype=np.float32)
        if resident.any():
            out[resident] = self.mem.peek(keys[resident])
        rest = np.flatnonzero(~resident)
        if rest.size:
            rows, found = self.store.load(keys[rest])
            rows[~found] = initial_rows(keys[rest][~found], self.mem.width, self.init)
            out[rest] = rows
        return out

    def flush(self) -> int:
        """Write every changed row to SSD-PS (after training, before export)."""
        return self.mem.flush()

    def stats(self) -> dict:
        return {**self.clock.snapshot(), "hit_rate": dict(self.hit_rate), "cache": self.mem.stats}
