"""``MemPSShard``: a node's MEM-PS (host-memory cache over its SSD-PS) as a Ray actor."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from hpsray.actors.livemetrics import LiveGauges
from hpsray.actors.messages import Pulled, Refresh, Returned
from hpsray.actors.timing import StageClock
from hpsray.kernels.distinct import is_sorted_distinct
from hpsray.kernels.init import RowInit
from hpsray.tiers.admission import Admission
from hpsray.tiers.lending import Lender, RowCache
from hpsray.tiers.mem import MemPS
from hpsray.tiers.padded import PaddedMemPS
from hpsray.tiers.rowgroups import RowGroups
from hpsray.tiers.warmup import warm_mem_ps


@dataclass
class _Write:
    """A dump (``rows``) or a delete (``rows is None``) submitted to SSD-PS and not known done."""

    ref: ray.ObjectRef
    keys: np.ndarray  # sorted
    rows: np.ndarray | None  # in key order; a zero-copy view of the object the dump reads
    hold: ray.ObjectRef | None = None  # that object


class _RemoteStore:
    """The MEM-PS engine's backing store, served by the node's ``SSDPSShard`` actor; it writes
    behind (:class:`~hpsray.tiers.mem.WritingBehindStore`).

    ``dump`` and ``delete`` are submitted without waiting; their keys and rows stay here (the
    victim buffer) until the call is seen done (``ray.wait(timeout=0)`` at every call), so
    :meth:`in_flight` answers for them and no pull names such a key missing: a key is missing
    only once the store has it, so a load the driver submits after the pull sees it (one
    caller's calls run in order on an actor, but the driver's loads and this actor's dumps are
    two callers). At most ``max_in_flight`` writes are in flight; beyond, the oldest is waited
    for (a stall). A failed write raises at every later call until :meth:`drain` is called
    after a reset, and its rows stay readable here. MEM-PS's own loads (:meth:`load`, for
    evaluation) run after its writes and see them.
    """

    def __init__(self, actor: Any, width: int, max_in_flight: int = 4) -> None:
        if max_in_flight < 1:
            raise ValueError(f"MemPSShard: dumps_in_flight must be >= 1, got {max_in_flight}")
        self.actor, self.width, self.max_in_flight = actor, width, max_in_flight
        self.batch: Hashable | None = None  # tags SSD time with the batch being pulled
        self.writes: deque[_Write] = deque()
        self.counts = {"writes": 0, "stalls": 0, "stall_s": 0.0, "max_in_flight": 0}

    def reap(self) -> None:
        """Forget the writes seen done, oldest first (they finish in order); raises a failed one's error."""
        if not self.writes:
            return
        done, _ = ray.wait([w.ref for w in self.writes], num_returns=len(self.writes), timeout=0)
        finished = set(done)
        while self.writes and self.writes[0].ref in finished:
            ray.get(self.writes[0].ref)  # raises its error, and it stays: its rows are nowhere else
            self.writes.popleft()

    def _submit(self, keys: np.ndarray, rows: np.ndarray | None) -> None:
        if keys.size == 0:
            return
        self.reap()
        while len(self.writes) >= self.max_in_flight:
            t0 = time.perf_counter()
            ray.wait([self.writes[0].ref], num_returns=1)
            self.counts["stalls"] += 1
            self.counts["stall_s"] += time.perf_counter() - t0
            self.reap()
        rows_ref = None
        if not is_sorted_distinct(keys):  # MEM-PS's own writes come sorted: no reordered copy
            order = np.argsort(keys, kind="stable")
            keys, rows = keys[order], (None if rows is None else rows[order])
        if rows is None:
            ref = self.actor.delete.remote(keys, self.batch)
        else:
            rows_ref = ray.put(np.ascontiguousarray(rows))
            ref = self.actor.dump.remote(keys, rows_ref, self.batch)
            rows = ray.get(rows_ref)  # read-only, shared with the object store: no second copy
        self.writes.append(_Write(ref, keys, rows, rows_ref))
        self.counts["writes"] += 1
        self.counts["max_in_flight"] = max(self.counts["max_in_flight"], len(self.writes))

    def dump(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self._submit(np.asarray(keys, np.uint64), rows)

    def delete(self, keys: np.ndarray) -> int:
        """Submits the delete; returns 0 (how many were stored is known only to SSD-PS)."""
        self._submit(np.asarray(keys, np.uint64), None)
        return 0

    def in_flight(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, found, deleted)`` of ``keys`` whose newest write is still in flight."""
        rows = np.zeros((keys.size, self.width), np.float32)
        found, deleted = np.zeros(keys.size, bool), np.zeros(keys.size, bool)
        open_ = np.ones(keys.size, bool)
        for w in reversed(self.writes):  # newest first: it wins
            if not open_.any():
                break
            ask = np.flatnonzero(open_)
            pos = np.minimum(np.searchsorted(w.keys, keys[ask]), w.keys.size - 1)
            there = w.keys[pos] == keys[ask]
            hit, at = ask[there], pos[there]
            if w.rows is None:
                deleted[hit] = True
            else:
                found[hit] = True
                rows[hit] = w.rows[at]
            open_[hit] = False
        return rows, found, deleted

    def load(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys``: from the writes in flight, else from SSD-PS (this actor's calls run
        after its writes there)."""
        self.reap()
        rows, found, deleted = self.in_flight(keys)
        rest = np.flatnonzero(~(found | deleted))
        if rest.size:
            got, there = ray.get(self.actor.load_found.remote(keys[rest]))  # rows of found keys only
            found[rest[there]] = True
            rows[rest[there]] = got
        return rows, found

    def drain(self, raise_errors: bool = True) -> None:
        """Wait until every write is done (a flush, a checkpoint); with ``raise_errors=False``
        (a reset) failed ones are dropped too."""
        refs = [w.ref for w in self.writes]
        if refs and raise_errors:
            ray.get(refs)
        elif refs:
            ray.wait(refs, num_returns=len(refs))
        self.writes.clear()


class MemPSShard:
    """The owner of one node's rows, lending them to the trainers of batches (the rules are
    :class:`~hpsray.tiers.lending.Lender`'s; this actor adds timing, metrics and the SSD-PS
    actor as a backing store that writes behind).

    ``dumps_in_flight``: evictions (and expiry deletes) submitted to SSD-PS and not yet done
    that a pull may leave behind before it waits for the oldest (their rows are held here
    meanwhile, beside the budget).

    ``groups``: tables of several row layouts, the row groups and each group's rows
    (:class:`~hpsray.tiers.padded.PaddedMemPS`; ``capacity_rows`` and ``capacity_bytes`` unused).

    ``admit_after`` and ``expire_after_batches``: feature admission and expiry
    (:class:`~hpsray.tiers.admission.Admission`; off by default); ``per_table_admission``: each
    table's pair instead, by key tag. ``admission_from``: a file
    :meth:`save_admission` wrote, whose counts this owner starts from (a checkpoint's).
    """

    def __init__(
        self,
        node: int,
        ssd_actor: Any,
        width: int,
        init: RowInit,
        capacity_rows: int | None = None,
        capacity_bytes: int | None = None,
        admit_after: int = 0,
        expire_after_batches: int | None = None,
        per_table_admission: list[tuple[int, int | None]] | None = None,
        admission_from: str | None = None,
        dumps_in_flight: int = 4,
        groups: tuple[RowGroups, list[int]] | None = None,
        **options: Any,
    ) -> None:
        self.node = node
        self.store = _RemoteStore(ssd_actor, width, dumps_in_flight)

        def make(admission_from: str | None = None) -> Lender:
            admission = Admission(admit_after, expire_after_batches, per_table=per_table_admission)
            if admission_from is not None:
                admission.load(admission_from)
            mem: RowCache
            if groups is None:
                mem = MemPS(capacity_rows, width, self.store, init, capacity_bytes=capacity_bytes, **options)
            else:  # tables of several row layouts: one cache per group, each row at its width
                mem = PaddedMemPS(groups[0], groups[1], width, self.store, init, **options)
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

    def pull(self, batch_id: Hashable, keys: np.ndarray, borrower: int | None = None) -> Pulled:
        """The loan of the distinct sorted ``keys`` this node owns to ``borrower``'s trainer
        (default: this node's) for ``batch_id``, pinned until it returns them: the rows held
        here, and the keys the load stage (``SSDPSShard.load_missing``) must add. Never waits on SSD-PS
        (but for a stall when ``dumps_in_flight`` evictions are still being written). Rows the
        borrower holds from its previous batch are pinned but not shipped (``Pulled.held``)."""
        with self.clock.timed(batch_id):
            self.store.batch = batch_id
            self.store.reap()
            pulled = self.lender.pull(batch_id, keys, borrower, skip_held=True)
            mem = self.lender.mem
            lease = (batch_id, self.node if borrower is None else borrower)
            st = mem.stats
            self.gauges.set(
                memps_hit_rate=mem.batch_stats(lease)["hit_rate"],
                memps_occupancy=st["size"] / st["capacity"],
                memps_pinned_rows=st["pinned_rows"],
            )
            return pulled

    def write_back(self, batch_id: Hashable, *returned: Returned) -> int:
        """Store the rows of ``batch_id`` its borrowers return and release their pins; returns
        the rows stored (see :meth:`Lender.write_back <hpsray.tiers.lending.Lender.write_back>`)."""
        with self.clock.timed(batch_id):
            self.store.batch = batch_id
            self.store.reap()
            return self.lender.write_back(batch_id, returned)

    def store_kept(self, *flushed: list[Returned]) -> int:
        """Store the rows trainers kept across a batch end: ``flushed`` holds each trainer's
        :meth:`Trainer.flush <hpsray.actors.trainer.Trainer.flush>`, one :class:`Returned` per
        owner (empty: it kept none); this owner stores its part, leases untouched. Returns the
        rows stored (see :meth:`Lender.store_kept <hpsray.tiers.lending.Lender.store_kept>`)."""
        self.store.reap()
        return self.lender.store_kept([parts[self.node] for parts in flushed if parts])

    def must_return(self, batch_id: Hashable, borrowers: int) -> tuple | np.ndarray:
        """Per borrower, the keys of the batch before ``batch_id`` it must return even if it
        keeps them (call with ``.options(num_returns=borrowers)``; see :meth:`Lender.must_return
        <hpsray.tiers.lending.Lender.must_return>`)."""
        out = self.lender.must_return(batch_id, borrowers)
        return tuple(out) if borrowers > 1 else out[0]

    def refresh(self, batch_id: Hashable, borrower: int) -> Refresh:
        """Rows lent to ``borrower`` for ``batch_id`` that others changed since (see
        :meth:`Lender.refresh <hpsray.tiers.lending.Lender.refresh>`)."""
        return self.lender.refresh(batch_id, borrower)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Current rows of ``keys`` for evaluation, nothing pinned."""
        return self.lender.lookup(keys)

    def reset(self, admission_from: str | None = None) -> None:
        """Drop every cached row and lease unwritten (a recovery: SSD-PS is restored to the
        checkpoint next, and this cache must not write newer rows into it: the writes still in
        flight are waited for first); the admission counts start again from
        ``admission_from`` (:meth:`save_admission`'s file) or empty."""
        self.store.drain(raise_errors=False)
        self.lender = self._make(admission_from)

    def save_admission(self, path: str) -> int:
        """Write the admission counts to ``path`` (for a checkpoint: take it where every batch
        is written back); returns its bytes, 0 (nothing written) with admission off."""
        adm = self.lender.admission
        return adm.save(path) if adm is not None else 0

    def flush(self) -> int:
        """Write every changed row to SSD-PS and wait until every write is done there (after
        training, before export or a snapshot); returns the rows flushed."""
        n = self.lender.mem.flush()
        self.store.drain()
        return n

    def stats(self) -> dict:
        cache = self.lender.mem.stats
        if self.lender.admission is not None:
            cache.update(self.lender.admission.stats)
        store = self.store.counts
        cache.update(
            dump_stalls=store["stalls"], dump_stall_s=store["stall_s"], dumps_in_flight_max=store["max_in_flight"]
        )
        return {
            **self.clock.snapshot(),
            "hit_rate": dict(self.lender.hit_rate),
            "by_tag": {k: v.tolist() for k, v in self.lender.by_tag.items()},
            "cache": cache,
            "owner_staleness": self.lender.max_staleness,
        }


def warm_admission() -> None:
    """Compile what admission and expiry run (numba: the key table's verbs) on a throwaway table."""
    keys = np.arange(1, 40, dtype=np.uint64)
    for k in (keys, np.frombuffer(keys.tobytes(), dtype=np.uint64)):  # writable, then read-only
        adm = Admission(2, 1, capacity=16)  # grows
        adm.see(0, k)
        adm.see(1, k[:5])
        adm.admitted(k)
        adm.expire(2)
