"""Lending rows: the MEM-PS owner's side of a batch (docs/architecture.md: invariants 2 and 4).

A node's MEM-PS *owns* the rows whose keys hash to it. For batch ``t`` it *lends* the rows a
trainer needs (its own node's, or another node's: the *borrower*) and pins them; at batch end
every borrower *returns* them, updated, and the owner stores them and drops the pins. Under BSP
every copy of a row received the same combined updates, so the owner ends each batch with the
reference value.

The pipeline lends the rows of batch ``t+1`` while ``t`` trains, so a row that some borrower
held in ``t`` was lent for ``t+1`` before ``t``'s write-back: stale. The borrower's *own* rows of
``t`` stay resident in its HBM-PS and are fresh; rows other borrowers changed are sent again by
:meth:`Lender.refresh` after the write-back of ``t``.

:class:`Lender` holds that logic over a :class:`~hpsray.tiers.mem.MemPS`; the Ray actor
``MemPSShard`` only adds timing, metrics and the remote store.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hpsray.kernels.init import RowInit, initial_rows
from hpsray.tiers.mem import BackingStore, MemPS

Lease = tuple[Hashable, int]  # (batch id, borrower node)


@dataclass(frozen=True)
class Returned:
    """A borrower's rows of one batch, going back to their owner: ``rows[i]`` is ``keys[i]``'s."""

    borrower: int
    keys: npt.NDArray[np.uint64]
    rows: npt.NDArray[np.float32]


@dataclass(frozen=True)
class Refresh:
    """Rows an owner sends again because another borrower changed them since they were lent."""

    keys: npt.NDArray[np.uint64]
    rows: npt.NDArray[np.float32]


class Lender:
    """The owner's ledger over its MEM-PS: what is lent to whom for which batch.

    Args:
        mem: the node's MEM-PS engine (cache over the backing store).
        node: this owner's node index (the default borrower).
        init: initial rows of keys that were never trained (for :meth:`lookup`).
    """

    def __init__(self, mem: MemPS, node: int, init: RowInit) -> None:
        self.mem, self.node, self.init = mem, node, init
        self.lent: dict[Lease, npt.NDArray[np.uint64]] = {}
        self.hit_rate: dict[Hashable, float] = {}
        self._hits: dict[Hashable, list[int]] = {}  # batch -> [hits, misses] over its leases

    @property
    def store(self) -> BackingStore:
        return self.mem.ssd

    def lend(self, batch_id: Hashable, keys: npt.NDArray[np.uint64], borrower: int | None = None) -> np.ndarray:
        """Rows of the distinct sorted ``keys`` (all owned here), pinned for ``(batch_id,
        borrower)`` until :meth:`take_back`; ``borrower`` defaults to this node."""
        lease = (batch_id, self.node if borrower is None else borrower)
        rows = self.mem.pull(lease, keys)
        self.lent[lease] = keys
        s = self.mem.batch_stats(lease)
        counts = self._hits.setdefault(batch_id, [0, 0])
        counts[0] += s["hits"]
        counts[1] += s["misses"]
        self.hit_rate[batch_id] = counts[0] / max(counts[0] + counts[1], 1)
        return rows

    def take_back(self, batch_id: Hashable, returned: Iterable[Returned]) -> int:
        """Store every borrower's rows of ``batch_id`` and release their pins; returns the rows
        stored. Leases of earlier batches are forgotten: their refresh is done."""
        n = 0
        for part in returned:
            lease = (batch_id, part.borrower)
            self.mem.write_back(lease, part.keys, part.rows)
            self.mem.unpin(lease)
            n += int(part.keys.size)
        for lease in [k for k in self.lent if _older(k[0], batch_id)]:
            del self.lent[lease]
        return n

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

    def refresh(self, batch_id: Hashable, borrower: int) -> Refresh:
        """Current rows of :meth:`stale` keys; call after the previous batch's :meth:`take_back`."""
        keys = self.stale(batch_id, borrower)
        rows = self.mem.peek(keys) if keys.size else np.empty((0, self.mem.width), np.float32)
        return Refresh(keys, rows)

    def lookup(self, keys: npt.NDArray[np.uint64]) -> np.ndarray:
        """Current rows of ``keys`` (evaluation): resident, else stored, else initial; no pins."""
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


def _previous(batch_id: Hashable) -> Hashable:
    return batch_id - 1 if isinstance(batch_id, int) else None


def _older(a: Hashable, b: Hashable) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a < b
