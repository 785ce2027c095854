"""``MemPSShard``: a node's MEM-PS (host-memory cache over its SSD-PS) as a Ray actor."""

from __future__ import annotations

import numpy as np
import ray

from hpsray.actors.livemetrics import LiveGauges
from hpsray.actors.messages import Refresh, Returned
from hpsray.actors.timing import StageClock
from hpsray.kernels.init import RowInit
from hpsray.tiers.admission import Admission
from hpsray.tiers.lending import Lender
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

    def delete(self, keys) -> int:
        return ray.get(self.actor.delete.remote(keys, self.batch))


class MemPSShard:
    """The owner of one node's rows, lending them to the trainers of batches (the rules are
    :class:`~hpsray.tiers.lending.Lender`'s; this actor adds timing, metrics and the SSD-PS
    actor as the backing store).

    ``admit_after`` and ``expire_after_batches``: feature admission and expiry
    (:class:`~hpsray.tiers.admission.Admission`; off by default). ``admission_from``: a file
    :meth:`save_admission` wrote, whose counts this owner starts from (a checkpoint's).
    """

    def __init__(
        self,
        node: int,
        ssd_actor,
        width: int,
        init: RowInit,
        capacity_rows: int | None = None,
        capacity_bytes: int | None = None,
        admit_after: int = 0,
        expire_after_batches: int | None = None,
        admission_from: str | None = None,
        **options,
    ) -> None:
        self.node = node
        self.store = _RemoteStore(ssd_actor, width)

        def make(admission_from: str | None = None) -> Lender:
            admission = Admission(admit_after, expire_after_batches)
            if admission_from is not None:
                admission.load(admission_from)
            mem = MemPS(capacity_rows, width, self.store, init, capacity_bytes=capacity_bytes, **options)
            return Lender(mem, node, init, admission)

        self._make = make
        self.lender = make(admission_from)
        warm_mem_ps(width, init, **options)  # numba compiles here, before the pipeline's clock
        if self.lender.admission is not None:
            warm_admission()
        self.clock = StageClock("pull", node)
        self.gauges = LiveGauges(stage="pull", node=node)

    def __repr__(self) -> str:
        return f"MemPS[node {self.node}]"

    def pull(self, batch_id, keys: np.ndarray, borrower: int | None = None) -> np.ndarray:
        """Rows of the distinct sorted ``keys`` this node owns, lent to ``borrower``'s trainer
        (default: this node's) for ``batch_id`` and pinned until it returns them."""
        with self.clock.timed(batch_id):
            self.store.batch = batch_id
            rows = self.lender.lend(batch_id, keys, borrower)
            mem = self.lender.mem
            lease = (batch_id, self.node if borrower is None else borrower)
            st = mem.stats
            self.gauges.set(
                memps_hit_rate=mem.batch_stats(lease)["hit_rate"],
                memps_occupancy=st["size"] / st["capacity"],
                memps_pinned_rows=st["pinned_rows"],
            )
            return rows

    def write_back(self, batch_id, *returned: Returned) -> int:
        """Take back the rows of ``batch_id`` from its borrowers; returns the rows stored."""
        with self.clock.timed(batch_id):
            self.store.batch = batch_id
            return self.lender.take_back(batch_id, returned)

    def refresh(self, batch_id, borrower: int) -> Refresh:
        """Rows lent to ``borrower`` for ``batch_id`` that others changed since (see
        :meth:`Lender.refresh <hpsray.tiers.lending.Lender.refresh>`)."""
        return self.lender.refresh(batch_id, borrower)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Current rows of ``keys`` for evaluation, nothing pinned."""
        return self.lender.lookup(keys)

    def reset(self, admission_from: str | None = None) -> None:
        """Drop every cached row and lease unwritten (a recovery: SSD-PS is restored to the
        checkpoint next, and this cache must not write newer rows into it); the admission
        counts start again from ``admission_from`` (:meth:`save_admission`'s file) or empty."""
        self.lender = self._make(admission_from)

    def save_admission(self, path: str) -> int:
        """Write the admission counts to ``path`` (for a checkpoint: take it where every batch
        is written back); returns its bytes, 0 (nothing written) with admission off."""
        adm = self.lender.admission
        return adm.save(path) if adm is not None else 0

    def flush(self) -> int:
        """Write every changed row to SSD-PS (after training, before export)."""
        return self.lender.mem.flush()

    def stats(self) -> dict:
        cache = self.lender.mem.stats
        if self.lender.admission is not None:
            cache.update(self.lender.admission.stats)
        return {**self.clock.snapshot(), "hit_rate": dict(self.lender.hit_rate), "cache": cache}


def warm_admission() -> None:
    """Compile what admission and expiry run (numba: the key table's verbs) on a throwaway table."""
    keys = np.arange(1, 40, dtype=np.uint64)
    for k in (keys, np.frombuffer(keys.tobytes(), dtype=np.uint64)):  # writable, then read-only
        adm = Admission(2, 1, capacity=16)  # grows
        adm.see(0, k)
        adm.see(1, k[:5])
        adm.admitted(k)
        adm.expire(2)
