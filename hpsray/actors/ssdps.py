"""``SSDPSShard``: a node's SSD-PS (parameter files on local disk) as a Ray actor."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import numpy as np
import ray

from hpsray.actors.livemetrics import LiveGauges
from hpsray.actors.messages import Loan, Pulled
from hpsray.actors.timing import StageClock
from hpsray.tiers.padded import PaddedSSDPS
from hpsray.tiers.rowgroups import RowGroups
from hpsray.tiers.ssd import SSDPS, restore_snapshot
from hpsray.tiers.ssd.bulkload import TableImport
from hpsray.tiers.ssd.grouped import GroupedSSDPS
from hpsray.tiers.ssd.outbuf import OutputPool
from hpsray.tiers.tagcount import N_TAGS, by_tag
from hpsray.tiers.warmup import warm_ssd_ps

WRITES = "writes"
"""The actor's concurrency group of MEM-PS's writes (:meth:`SSDPSShard.dump`, ``delete``): one
thread of their own, so a batch's load does not wait behind the evicted rows' writes and fsyncs
(:func:`actor_class` declares it)."""


class SSDPSShard:
    """Owns one node's parameter-file directory: the load stage (:meth:`load_missing`: the rows
    a pull left missing), and MEM-PS's backing store (:meth:`load_found`, :meth:`dump`,
    :meth:`delete`: the engine's ``load`` less absent keys' rows, ``dump`` and ``delete``).

    Writes run on their own thread (:data:`WRITES`), beside the loads: the engine takes both at
    once, and no load asks for a key whose write is still in flight (MEM-PS serves those from
    its victim buffer until it sees the write done). :meth:`restore` and :meth:`close` wait for
    a write in progress, and a later write goes to the store that replaced it, as when the two
    ran one after the other.

    Two clocks: ``load`` times the load stage (its events are the stage's intervals), ``dump``
    the writes MEM-PS hands down (tagged with the batch whose pull or write-back made them).
    """

    def __init__(
        self,
        node: int,
        directory: str,
        width: int,
        restore_from: str | None = None,
        init_from: TableImport | None = None,
        groups: RowGroups | None = None,
        **options: Any,
    ) -> None:
        """``restore_from``: a snapshot (:meth:`snapshot`) that replaces ``directory`` first;
        ``init_from``: a table a fresh store loads (not when restoring: the snapshot has it);
        ``groups``: tables of several row layouts, each group's rows stored at its width
        (:class:`~hpsray.tiers.padded.PaddedSSDPS`; rows cross at ``width``)."""
        self.node = node
        self.directory, self.width, self.options, self.groups = directory, width, options, groups
        self.restored = self._restore(restore_from) if restore_from else None
        self.store = self._open()
        self.swap = threading.Lock()  # a write, or the store's replacement (restore, close)
        self.imported = None
        if init_from is not None and restore_from is None:
            if node != 0:
                raise ValueError(f"tiers.init_from loads one node's SSD-PS; node {node} cannot load it")
            self.imported = self.store.bulk_load(init_from)
        warm_ssd_ps(width, **options)  # numba compiles here, before the pipeline's clock
        self.clock = StageClock("load", node)
        self.writes = StageClock("dump", node)
        self.counts = {"loads": 0, "loaded": 0, "initialised": 0}
        self.by_tag = {"loaded": np.zeros(N_TAGS, np.int64), "initialised": np.zeros(N_TAGS, np.int64)}
        self.gauges = LiveGauges(stage="load", node=node)
        self.loans = OutputPool()  # the memory of the last loan's rows, once Ray has copied them out

    def _export(self) -> None:
        st = self.store.stats
        self.gauges.set(
            ssd_bytes_read=st["bytes_read"],
            ssd_bytes_written=st["bytes_written"],
            ssd_live_bytes=st["live_bytes"],
            ssd_disk_bytes=st["disk_bytes"],
            ssd_compactions=st["compactions"],
        )

    def __repr__(self) -> str:
        return f"SSDPS[node {self.node}]"

    def load_missing(self, batch_id: Hashable, pulled: Pulled) -> Loan:
        """The load stage: ``pulled``'s loan as the trainer takes it, its missing rows read from
        the parameter files (initial rows for keys never stored). Every write MEM-PS saw done
        before the pull has run here, and a row still in flight was not missing."""
        found_keys = []

        def load(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            rows, found = self.store.load(keys)
            found_keys.append(keys[found])
            return rows, found

        with self.clock.timed(batch_id):
            rows, loaded = pulled.load_missing(load, self.loans.rows)
        missing = int(pulled.missing.size)
        self.counts["loads"] += 1
        self.counts["loaded"] += loaded
        self.counts["initialised"] += missing - loaded
        if missing:  # per table (tag): the missing keys, and those the files held, are sorted
            from_files = by_tag(found_keys[0]) if found_keys else 0
            self.by_tag["loaded"] += from_files
            self.by_tag["initialised"] += by_tag(pulled.missing_keys) - from_files
        if missing:
            self._export()
        return Loan(rows, pulled.held)

    def load_found(self, keys: np.ndarray, batch: Hashable | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(rows float32[found.sum(), width] of the found keys only, in key order; found
        bool[n])``: :meth:`SSDPS.load <hpsray.tiers.ssd.SSDPS.load>` less the zero rows of absent
        keys, so that only found rows cross to MEM-PS (its own reads, for evaluation; a first pass
        finds none). ``load`` everywhere else returns a row per key."""
        with self.clock.timed(batch):
            rows, found = self.store.load(keys)
        self._export()
        return (rows, found) if found.all() else (rows[found], found)

    @ray.method(concurrency_group=WRITES)
    def dump(self, keys: np.ndarray, rows: np.ndarray, batch: Hashable | None = None) -> None:
        with self.swap, self.writes.timed(batch):
            self.store.dump(keys, rows)
        self._export()

    @ray.method(concurrency_group=WRITES)
    def delete(self, keys: np.ndarray, batch: Hashable | None = None) -> int:
        """Delete the rows of ``keys`` (expiry); returns how many were stored."""
        with self.swap, self.writes.timed(batch):
            n = self.store.delete(keys)
        self._export()
        return n

    def snapshot(self, dest: str) -> dict:
        """Reference the store's current state in ``dest`` (a checkpoint's node directory)."""
        return self.store.snapshot(dest)

    def upload_checkpoint(self, location: str, staging: str, token: str | None = None) -> dict:
        """Upload this node's files of a staged checkpoint to object storage, from this host
        (:func:`~hpsray.checkpoint.remote.upload_node`)."""
        from hpsray.checkpoint.remote import upload_node

        return upload_node(location, staging, self.node, token)

    def _open(self) -> Any:
        if self.groups is None:
            return SSDPS(self.directory, self.width, **self.options)
        return PaddedSSDPS(self.directory, self.groups, self.width, **self.options)

    def _restore(self, snapshot: str) -> dict:
        if self.groups is None:
            return restore_snapshot(snapshot, self.directory, replace=True)
        return GroupedSSDPS.restore(snapshot, self.directory, self.groups, replace=True)

    def restore(self, snapshot: str) -> dict:
        """Replace the store with a snapshot's state (a recovery that keeps this process)."""
        with self.swap:
            self.store.close()
            self.restored = self._restore(snapshot)
            self.store = self._open()
        return self.restored

    def scan(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every live row, file by file."""
        return list(self.store.scan())

    def stats(self, live_by_tag: bool = False) -> dict:
        """The load clock's figures, the dump clock's (``dump``), the store's, and the rows the
        load stage ``loaded`` from files or ``initialised`` (also ``by_tag``: per key tag, a table;
        ``live_by_tag``: with the store's live rows per tag, ``by_tag["live"]``, one pass over
        its key map)."""
        by_tag = {k: v.tolist() for k, v in self.by_tag.items()}
        if live_by_tag:
            by_tag["live"] = self.store.live_rows_by_tag().tolist()
        clocks = {**self.clock.snapshot(), "dump": self.writes.snapshot()}
        return {**clocks, "store": self.store.stats, **self.counts, "by_tag": by_tag}

    def close(self) -> None:
        with self.swap:
            self.store.close()


def actor_class() -> Any:
    """:class:`SSDPSShard` as a Ray actor class, its :data:`WRITES` group declared."""
    # Ray's stubs lack this keyword's overload
    return ray.remote(concurrency_groups={WRITES: 1})(SSDPSShard)  # type: ignore[call-overload]
