"""``MemPSShard``: a node's MEM-PS (host-memory cache over its SSD-PS) as a Ray actor."""

from __future__ import annotations

import numpy as np
import ray

from hpsray.actors.livemetrics import LiveGauges
from hpsray.actors.timing import StageClock
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.tiers.mem import MemPS
from hpsray.tiers.warmup import warm_mem_ps


class _RemoteStore:
    """The MEM-PS engine's backing store, served by the node's ``SSDPSShard`` actor."""

    def __init__(self, actor, width: int) -> None:
        self.actor, self.width = actor, width
        self.batch = None  # tags SSD time with the batch being pulled

    def load(self, keys):
        found_rows, found = ray.get(self.actor.load.remote(keys, self.batch))  # rows of found keys only
        if found_rows.shape[0] == found.size:
            return np.array(found_rows), found  # object-store arrays are read-only; the engine fills misses in place
        rows = np.zeros((found.size, self.width), dtype=np.float32)  # untouched pages cost nothing
        if found_rows.shape[0]:
            rows[found] = found_rows
        return rows, found

    def dump(self, keys, rows) -> None:
        ray.get(self.actor.dump.remote(keys, rows, self.batch))


class MemPSShard:
    """The owner of one node's rows: lends them to the trainers of batches and takes them back.

    A *lease* ``(batch, borrower)`` pins the rows lent to node ``borrower``'s trainer for
    ``batch`` (its own trainer, or another node's) until that trainer returns them at batch
    end. Every borrower returns every row it borrowed, updated: under BSP all copies applied
    the same combined updates, so the owner ends each batch with the reference value of each
    row it owns even when only another node's batch touched it (docs/architecture.md: invariant 4).
    """

    def __init__(
        self,
        node: int,
        ssd_actor,
        width: int,
        init: RowInit,
        capacity_rows: int | None = None,
        capacity_bytes: int | None = None,
        **options,
    ) -> None:
        self.node = node
        self.init = init
        self.store = _RemoteStore(ssd_actor, width)
        self.mem = MemPS(capacity_rows, width, self.store, init, capacity_bytes=capacity_bytes, **options)
        warm_mem_ps(width, init, **options)  # numba compiles here, before the pipeline's clock
        self.clock = StageClock("pull", node)
        self.gauges = LiveGauges(stage="pull", node=node)
        self.hit_rate: dict = {}
        self._hits: dict = {}  # batch -> [hits, misses] over its leases
        self.lent: dict = {}  # (batch, borrower) -> sorted keys lent

    def __repr__(self) -> str:
        return f"MemPS[node {self.node}]"

    def pull(self, batch_id, keys: np.ndarray, borrower: int | None = None) -> np.ndarray:
        """Rows of the distinct sorted ``keys`` this node owns, lent to ``borrower``'s trainer
        (default: this node's) for ``batch_id`` and pinned until it returns them."""
        lease = (batch_id, self.node if borrower is None else borrower)
        with self.clock.timed(batch_id):
            self.store.batch = batch_id
            rows = self.mem.pull(lease, keys)
            self.lent[lease] = keys
            s = self.mem.batch_stats(lease)
            counts = self._hits.setdefault(batch_id, [0, 0])
            counts[0] += s["hits"]
            counts[1] += s["misses"]
            self.hit_rate[batch_id] = counts[0] / max(counts[0] + counts[1], 1)
            st = self.mem.stats
            self.gauges.set(
                memps_hit_rate=s["hit_rate"],
                memps_occupancy=st["size"] / st["capacity"],
                memps_pinned_rows=st["pinned_rows"],
            )
            return rows

    def write_back(self, batch_id, *returned: dict) -> int:
        """Take back the rows of ``batch_id`` from its borrowers (one ``{"borrower", "keys",
        "rows"}`` per borrower), store them and release their pins; returns the rows stored."""
        with self.clock.timed(batch_id):
            self.store.batch = batch_id
            n = 0
            for part in returned:
                lease = (batch_id, part["borrower"])
                self.mem.write_back(lease, part["keys"], part["rows"])
                self.mem.unpin(lease)
                n += int(part["keys"].size)
            for lease in [k for k in self.lent if k[0] < batch_id]:  # refresh(batch_id) is done
                del self.lent[lease]
            return n

    def refresh(self, batch_id, borrower: int) -> dict:
        """Current rows of the keys lent to ``borrower`` for ``batch_id`` that other borrowers
        held in batch ``batch_id - 1``: ``pull(batch_id)`` served them before that batch's
        write-back (it overlapped the training), so they were stale (docs/architecture.md: invariant 2). The
        borrower's own rows of the previous batch are still in its HBM-PS, and fresh."""
        keys = self.lent[(batch_id, borrower)]
        others = [k for (b, n), k in self.lent.items() if b == batch_id - 1 and n != borrower]
        mine = self.lent.get((batch_id - 1, borrower))
        stale = keys[np.isin(keys, np.concatenate(others))] if others and keys.size else keys[:0]
        if mine is not None and stale.size:
            stale = stale[~np.isin(stale, mine)]
        rows = self.mem.peek(stale) if stale.size else np.empty((0, self.mem.width), np.float32)
        return {"keys": stale, "rows": rows}

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
