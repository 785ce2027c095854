"""A pull that loads its misses at once, for tests of MEM-PS and the owner's rules.

The engines have one pull (:meth:`MemPS.pull <hpsray.tiers.mem.MemPS.pull>`,
:meth:`Lender.pull <hpsray.tiers.lending.Lender.pull>`) that leaves the rows they do not hold
to the load stage. These helpers do that stage's work in place, as one call, and give the
reserved slots their loaded rows (clean: the store holds them), so a test reads rows back at
once; the counts they leave (hits, misses, loaded, initialised) are those of a pull followed by
its load.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
from numpy.typing import ArrayLike

from hpsray.kernels.table import as_keys, as_rows
from hpsray.tiers.lending import Lender
from hpsray.tiers.loans import Pulled
from hpsray.tiers.mem import MemPS


def fill(mem: MemPS, keys: ArrayLike, rows: ArrayLike, batch_id: Hashable | None = None, loaded: int = 0) -> int:
    """Give the reserved slots among ``keys`` their loaded ``rows`` (clean); other keys are
    skipped. Returns how many slots were filled. With ``batch_id``, counts ``loaded`` of the
    keys as loaded for it and the others as initialised."""
    keys = as_keys(keys)
    rows = as_rows(rows, keys.size, mem.width, "fill rows")
    with mem._lock:
        if batch_id is not None:
            mem._count(batch_id, loaded=loaded, initialised=keys.size - loaded)
        slots = mem._table.find(keys)
        pick = np.flatnonzero(slots >= 0)
        pick = pick[mem._reserved[slots[pick]]]
        if pick.size:
            mem._table.put(slots[pick], rows[pick])
            mem._reserved[slots[pick]] = False
        return int(pick.size)


def pull_loaded(mem: MemPS, batch_id: Hashable, keys: ArrayLike) -> np.ndarray:
    """Rows of ``keys`` (``float32[n, width]``, duplicates allowed), pinned for ``batch_id``:
    :meth:`MemPS.pull` and then its misses loaded from ``mem.ssd`` (initial rows for keys it
    never stored) into their slots."""
    keys = as_keys(keys)
    uk, inv = np.unique(keys, return_inverse=True)
    rows, missing = mem.pull(batch_id, uk)
    rows, loaded = Pulled(rows, missing, uk[missing], mem.init).load_missing(mem.ssd.load)
    fill(mem, uk[missing], rows[missing], batch_id, loaded)
    return rows[inv.reshape(-1)]


def lend(lender: Lender, batch_id: Hashable, keys: np.ndarray, borrower: int | None = None) -> np.ndarray:
    """:meth:`Lender.pull` with the load stage done here: the rows of the distinct sorted ``keys``,
    pinned for ``(batch_id, borrower)`` until :meth:`Lender.write_back`."""
    pulled = lender.pull(batch_id, keys, borrower)
    rows, loaded = pulled.load_missing(lender.store.load)
    lease = (batch_id, lender.node if borrower is None else borrower)
    fill(lender.mem, pulled.missing_keys, rows[pulled.missing], lease, loaded)
    return rows
