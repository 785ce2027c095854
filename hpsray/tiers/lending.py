"""Lending rows: the MEM-PS owner's side of a batch (docs/architecture.md: invariants 2 and 4).

A node's MEM-PS *owns* the rows whose keys hash to it. For batch ``t`` it *lends* the rows a
trainer needs (its own node's, or another node's: the *borrower*) and pins them
(:meth:`Lender.pull`); at batch end every borrower *returns* them, updated, and the owner stores
them and drops the pins (:meth:`Lender.write_back`). Under BSP
every copy of a row received the same combined updates, so the owner ends each batch with the
reference value.

The pipeline lends the rows of batch ``t+1`` while ``t`` trains, so a row that some borrower
held in ``t`` was lent for ``t+1`` before ``t``'s write-back: stale. The borrower's *own* rows of
``t`` stay resident in its HBM-PS and are fresh; rows other borrowers changed are sent again by
:meth:`Lender.refresh` after the write-back of ``t``.

:class:`Lender` holds that logic over a :class:`RowCache` (a :class:`~hpsray.tiers.mem.MemPS`,
or a :class:`~hpsray.tiers.padded.PaddedMemPS` over tables of several row layouts); the Ray actor
``MemPSShard`` only adds timing, metrics and the remote store.

With an :class:`~hpsray.tiers.admission.Admission` (docs/architecture.md: Admission and expiry)
the owner also decides, per batch, which keys get a row. A key not admitted is lent its initial
row, is neither stored nor pinned, and its returned row is dropped; since a borrower keeps rows
resident across batches, :meth:`Lender.refresh` sends the initial row again to every borrower
that held it in the batch before. Keys that expire are dropped from MEM-PS and deleted from
SSD-PS at the first loan of the next batch (before it is counted) and again at the write-back.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Protocol

import numpy as np
import numpy.typing as npt
from numpy.typing import ArrayLike

from hpsray.kernels.distinct import in_sorted
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.tiers.admission import Admission
from hpsray.tiers.loans import Pulled, Refresh, Returned
from hpsray.tiers.mem import BackingStore, DeletingStore
from hpsray.tiers.tagcount import N_TAGS, by_tag

__all__ = ["Lease", "Lender", "RowCache"]

Lease = tuple[Hashable, int]  # (batch id, borrower node)


class RowCache(Protocol):
    """What a lender and its actor use of a node's MEM-PS (:class:`~hpsray.tiers.mem.MemPS`'s
    methods, which state the contracts)."""

    @property
    def width(self) -> int: ...
    @property
    def ssd(self) -> BackingStore: ...
    @property
    def stats(self) -> dict: ...
    def pull(
        self, batch_id: Hashable, keys: ArrayLike, held: np.ndarray | None = None, compact: bool = False
    ) -> tuple[np.ndarray, np.ndarray]: ...
    def write_back(self, batch_id: Hashable, keys: ArrayLike, rows: ArrayLike) -> None: ...
    def store_kept(self, keys: ArrayLike, rows: ArrayLike) -> np.ndarray: ...
    def unpin(self, batch_id: Hashable) -> None: ...
    def drop(self, keys: ArrayLike) -> int: ...
    def has_rows(self, keys: ArrayLike) -> np.ndarray: ...
    def peek(self, keys: ArrayLike) -> np.ndarray: ...
    def batch_stats(self, batch_id: Hashable) -> dict: ...
    def flush(self) -> int: ...


class Lender:
    """The owner's ledger over its MEM-PS: what is lent to whom for which batch.

    Args:
        mem: the node's MEM-PS engine (cache over the backing store).
        node: this owner's node index (the default borrower).
        init: initial rows of keys that were never trained (for :meth:`lookup`).
        admission: the admission and expiry rules (``None``, or one with neither rule on:
            every key gets a row and none expires). Expiry needs a store that deletes.
    """

    def __init__(self, mem: RowCache, node: int, init: RowInit, admission: Admission | None = None) -> None:
        self.mem, self.node, self.init = mem, node, init
        self.admission = admission if admission is not None and admission.enabled else None
        if (
            self.admission is not None
            and self.admission.expire_after is not None
            and not callable(getattr(mem.ssd, "delete", None))
        ):
            raise TypeError(f"expiry deletes rows from the backing store, and {type(mem.ssd).__name__} has no delete")
        self.lent: dict[Lease, npt.NDArray[np.uint64]] = {}
        self.rejected: dict[Lease, npt.NDArray[np.uint64]] = {}  # keys lent without a row
        self.hit_rate: dict[Hashable, float] = {}
        self.max_staleness = 0  # most mini-batches of updates a row kept at a batch end lacked
        self._hits: dict[Hashable, list[int]] = {}  # batch -> [hits, misses] over its leases
        self.by_tag = {"lookups": np.zeros(N_TAGS, np.int64), "misses": np.zeros(N_TAGS, np.int64)}  # per table

    @property
    def store(self) -> BackingStore:
        return self.mem.ssd

    def pull(
        self, batch_id: Hashable, keys: npt.NDArray[np.uint64], borrower: int | None = None, skip_held: bool = False
    ) -> Pulled:
        """Lend the distinct sorted ``keys`` (all owned here) to ``borrower`` (default: this
        node) for ``batch_id``, pinned until :meth:`write_back`: the rows held here, and the keys
        (and positions) of the rows the load stage must get from the store
        (:meth:`Pulled.load_missing`). Their slots are reserved and pinned, so the row
        :meth:`write_back` returns has its place; the store holds their newest value until then
        (a key whose dump is still in flight is served from the store's ``in_flight`` rows,
        never named missing).

        With ``skip_held``, the rows of keys this borrower was lent for the batch before are
        not shipped (:attr:`Pulled.held`): its trainer keeps them resident, fresher than any
        copy here (docs/architecture.md: The trainer's working set). They are pinned all the
        same, so they are resident, never missing, and have their slots for the return."""
        lease = (batch_id, self.node if borrower is None else borrower)
        held = self._held(lease, keys) if skip_held else None
        compact = self.admission is None and held is not None  # the held rows are never gathered
        if self.admission is None:
            rows, missing = self.mem.pull(lease, keys, held, compact=compact)
        else:
            rows, missing = self._lend_admitted(lease, keys, held)
        self.lent[lease] = keys
        s = self.mem.batch_stats(lease)
        counts = self._hits.setdefault(batch_id, [0, 0])
        counts[0] += s["hits"]
        counts[1] += s["misses"]
        self.hit_rate[batch_id] = counts[0] / max(counts[0] + counts[1], 1)
        self.by_tag["lookups"] += by_tag(keys)
        self.by_tag["misses"] += by_tag(keys[missing])  # missing: ascending positions, so sorted keys
        if held is None:
            return Pulled(rows, missing, keys[missing], self.init)
        missing = missing[~held[missing]]  # a held key's row is on the trainer: never loaded again
        position = np.cumsum(~held) - 1  # of each key among those shipped
        return Pulled(rows if compact else rows[~held], position[missing], keys[missing], self.init, held)

    def _held(self, lease: Lease, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_] | None:
        """Which of ``keys`` (sorted, distinct) the borrower of ``lease`` was lent for the batch
        before (``None``: none, or no such lease)."""
        before = self.lent.get((_previous(lease[0]), lease[1]))
        if before is None:
            return None
        held = in_sorted(keys, before)
        return held if held.any() else None

    def _lend_admitted(
        self, lease: Lease, keys: npt.NDArray[np.uint64], held: npt.NDArray[np.bool_] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`pull` under admission: expire what the previous batch's end expires,
        count the keys, and lend admitted keys their rows and the others their initial rows."""
        adm = self.admission
        assert adm is not None
        batch_id = lease[0]
        if not isinstance(batch_id, int):
            raise TypeError(f"admission counts batches: batch ids must be integers, got {batch_id!r}")
        self._expire(batch_id - 1)  # before counting: an expired key starts afresh
        admitted = adm.see(batch_id, keys)
        if admitted.all():
            return self.mem.pull(lease, keys, held)
        rows = np.empty((keys.size, self.mem.width), dtype=np.float32)
        rows[admitted], missing = self.mem.pull(lease, keys[admitted], None if held is None else held[admitted])
        rejected = keys[~admitted]
        rows[~admitted] = initial_rows(rejected, self.mem.width, self.init)
        self.rejected[lease] = rejected
        return rows, np.flatnonzero(admitted)[missing]

    def _expire(self, through: int) -> int:
        """Drop the rows that expire at the end of batch ``through`` from MEM-PS and SSD-PS."""
        assert self.admission is not None
        keys = self.admission.expire(through)
        if keys.size:
            self.mem.drop(keys)
            store: DeletingStore = self.mem.ssd  # type: ignore[assignment]  # checked in __init__
            store.delete(keys)
        return int(keys.size)

    def write_back(self, batch_id: Hashable, returned: Iterable[Returned]) -> int:
        """Store every borrower's rows of ``batch_id`` and release their pins; returns the rows
        stored (not those of keys lent without a row). Leases of earlier batches are forgotten:
        their refresh is done. Under expiry, then drops the rows expiring at this batch's end.

        Where borrowers return different copies of a row (SSP/ASP across batch ends), the
        freshest wins: the copy with the least :attr:`Returned.staleness`, the later borrower
        on a tie; complete copies (BSP) are stored in the order given, as before."""
        parts = list(returned)
        if any(p.applied is not None for p in parts):
            parts.sort(key=lambda p: -p.staleness)  # stable: the freshest is stored last and wins
            self.max_staleness = max(self.max_staleness, _kept_staleness(parts))
        n = 0
        for part in parts:
            lease = (batch_id, part.borrower)
            keys, rows = part.keys, part.rows
            rejected = self.rejected.get(lease)
            if rejected is not None:
                keep = ~np.isin(keys, rejected)
                keys, rows = keys[keep], rows[keep]
            self.mem.write_back(lease, keys, rows)
            self.mem.unpin(lease)
            n += int(keys.size)
        for table in (self.lent, self.rejected):
            for lease in [k for k in table if _older(k[0], batch_id)]:
                del table[lease]
        if self.admission is not None and isinstance(batch_id, int):
            self._expire(batch_id)
        return n

    def store_kept(self, returned: Iterable[Returned]) -> int:
        """Store rows a borrower kept across batch ends (a flush: before a checkpoint, at a
        stop, after a failure) without touching leases: resident keys get their row in place
        (dirty), the others go straight to the store. Keys lent without a row are skipped.
        Returns the rows stored."""
        parts = [k for k in self.rejected.values() if k.size]
        rejected = np.concatenate(parts) if parts else None
        n = 0
        for part in returned:
            keys, rows = part.keys, part.rows
            if rejected is not None and keys.size:
                keep = ~np.isin(keys, rejected)
                keys, rows = keys[keep], rows[keep]
            if not keys.size:
                continue
            placed = self.mem.store_kept(keys, rows)
            if not placed.all():
                self.store.dump(keys[~placed], rows[~placed])
            n += int(keys.size)
        return n

    def must_return(self, batch_id: Hashable, borrowers: int) -> list[npt.NDArray[np.uint64]]:
        """Per borrower ``0 .. borrowers-1``, the keys it was lent for the batch before
        ``batch_id`` that it must return at that batch's end even if it keeps them: those
        another borrower is lent for ``batch_id`` without having held them (its
        :meth:`refresh` reads this owner's copy). Call once every lease of ``batch_id`` is
        lent; with one missing, every key is named (keep nothing)."""
        previous = _previous(batch_id)
        before = [self.lent.get((previous, b), np.empty(0, np.uint64)) for b in range(borrowers)]
        if any((batch_id, b) not in self.lent for b in range(borrowers)):
            return before
        new = [np.setdiff1d(self.lent[(batch_id, c)], before[c], assume_unique=True) for c in range(borrowers)]
        out = []
        for b in range(borrowers):
            others = [new[c] for c in range(borrowers) if c != b and new[c].size]
            need = np.concatenate(others) if others else np.empty(0, np.uint64)
            out.append(before[b][np.isin(before[b], need)] if need.size and before[b].size else before[b][:0])
        return out

    def stale(self, batch_id: Hashable, borrower: int) -> npt.NDArray[np.uint64]:
        """Keys lent to ``borrower`` for ``batch_id`` that other borrowers held in the batch
        before (so their copy lent early is stale), minus the borrower's own keys of that batch
        (still resident in its HBM-PS, and fresh)."""
        keys = self.lent[(batch_id, borrower)]
        previous = _previous(batch_id)
        others = [k for (b, n), k in self.lent.items() if b == previous and n != borrower]
        if not others or not keys.size:
            return keys[:0]
        stale = keys[np.isin(keys, np.concatenate(others))]
        mine = self.lent.get((previous, borrower))
        return stale[~np.isin(stale, mine)] if mine is not None and stale.size else stale

    def reset_keys(self, batch_id: Hashable, borrower: int) -> npt.NDArray[np.uint64]:
        """Keys lent to ``borrower`` for ``batch_id`` that were lent without a row in the batch
        before: whoever held them trained them, and those updates are dropped, so every copy
        starts again from the initial row (the borrower's own copy is still resident)."""
        previous = _previous(batch_id)
        before = [k for (b, _), k in self.rejected.items() if b == previous]
        keys = self.lent[(batch_id, borrower)]
        if not before or not keys.size:
            return keys[:0]
        return keys[np.isin(keys, np.concatenate(before))]

    def refresh(self, batch_id: Hashable, borrower: int) -> Refresh:
        """Current rows of :meth:`stale` keys, and the initial rows of :meth:`reset_keys`; call
        after the previous batch's :meth:`write_back`."""
        keys = self.stale(batch_id, borrower)
        reset = self.reset_keys(batch_id, borrower) if self.admission is not None else keys[:0]
        if reset.size:
            keys = keys[~np.isin(keys, reset)]
        rows = self.mem.peek(keys) if keys.size else np.empty((0, self.mem.width), np.float32)
        if reset.size:
            keys = np.concatenate([keys, reset])
            rows = np.concatenate([rows, initial_rows(reset, self.mem.width, self.init)])
            order = np.argsort(keys)
            keys, rows = keys[order], rows[order]
        return Refresh(keys, rows)

    def lookup(self, keys: npt.NDArray[np.uint64]) -> np.ndarray:
        """Current rows of ``keys`` (evaluation): resident, else stored (a store that writes
        behind answers from its rows in flight first), else initial; no pins."""
        resident = self.mem.has_rows(keys)
        out = np.empty((keys.size, self.mem.width), dtype=np.float32)
        if resident.any():
            out[resident] = self.mem.peek(keys[resident])
        rest = np.flatnonzero(~resident)
        if rest.size:
            rows, found = self.store.load(keys[rest])
            rows[~found] = initial_rows(keys[rest][~found], self.mem.width, self.init)
            out[rest] = rows
        return out


def _kept_staleness(parts: list[Returned]) -> int:
    """The staleness of the copies that win at least one key when ``parts`` are stored in order
    (a later part's copy of a key overwrites an earlier one's)."""
    covered = np.empty(0, np.uint64)
    worst = 0
    for part in reversed(parts):
        if part.keys.size and (not covered.size or not np.isin(part.keys, covered).all()):
            worst = max(worst, part.staleness)
        covered = np.union1d(covered, part.keys)
    return worst


def _previous(batch_id: Hashable) -> Hashable:
    return batch_id - 1 if isinstance(batch_id, int) else None


def _older(a: Hashable, b: Hashable) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a < b
