"""The loan protocol's data: what an owner lends (:class:`Pulled`, then :class:`Loan`), sends
again (:class:`Refresh`) and gets back (:class:`Returned`); docs/architecture.md, Glossary.

These are actor messages (:mod:`hpsray.actors.messages` is their spec and re-exports them),
defined here because two Ray-free engines build and read them (the owner's
:class:`~hpsray.tiers.lending.Lender` and the trainer's :mod:`hpsray.training.engine`), and
engines never import the actor package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hpsray.kernels.init import RowInit, initial_rows

__all__ = ["Loan", "Pulled", "Refresh", "Returned"]


@dataclass(frozen=True)
class Returned:
    """A borrower's rows of one batch, going back to their owner: ``rows[i]`` is ``keys[i]``'s.

    Under SSP/ASP across batch ends (docs/architecture.md: Consistency) copies of a row may
    differ: ``clock`` is the borrower's clock at the batch end and ``applied`` the oldest clock
    of the other trainers whose updates the copy holds (``None``: a complete copy, as under
    BSP, where every copy is the same)."""

    borrower: int
    keys: npt.NDArray[np.uint64]
    rows: npt.NDArray[np.float32]
    clock: int = 0
    applied: int | None = None

    @property
    def staleness(self) -> int:
        """Mini-batches of some other trainer's updates this copy may lack (0: complete)."""
        return 0 if self.applied is None else max(self.clock - self.applied, 0)


@dataclass(frozen=True)
class Pulled:
    """A loan whose missing rows are still to be loaded (the pull stage's output, the load
    stage's input): ``rows[i]`` is the row of the ``i``-th key *shipped* except at the positions
    ``missing``, whose keys ``missing_keys`` the owner does not hold; :meth:`load_missing` fills them
    from the store, or with ``init``'s rows for keys it never stored.

    ``held`` (one flag per key of the loan; ``None``: none) marks the keys the borrower holds
    from its previous batch: their rows stay on the trainer and are not shipped, so the keys
    shipped are those not ``held`` (docs/architecture.md: The trainer's working set)."""

    rows: npt.NDArray[np.float32]
    missing: npt.NDArray[np.int64]
    missing_keys: npt.NDArray[np.uint64]
    init: RowInit
    held: npt.NDArray[np.bool_] | None = None

    def load_missing(
        self,
        load: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
        empty: Callable[[int, int], np.ndarray] | None = None,
    ) -> tuple[npt.NDArray[np.float32], int]:
        """``(rows, loaded)``: the rows shipped, the missing ones from ``load(keys) -> (rows,
        found)`` (a store's), initial rows where not found; ``loaded`` counts the rows found.
        ``rows`` is a writable copy (an object-store array is read-only), in memory from
        ``empty(n, width)`` where given (an uninitialised ``float32[n, width]``, e.g. a reused
        buffer's, :class:`~hpsray.tiers.ssd.outbuf.OutputPool`), else newly allocated."""
        if empty is None:
            rows = np.array(self.rows)
        else:
            rows = empty(*self.rows.shape)
            np.copyto(rows, self.rows)
        if not self.missing.size:
            return rows, 0
        got, found = load(self.missing_keys)
        loaded = int(np.count_nonzero(found))
        if loaded < found.size:
            got = np.array(got)
            got[~found] = initial_rows(self.missing_keys[~found], rows.shape[1], self.init)
        rows[self.missing] = got
        return rows, loaded


@dataclass(frozen=True)
class Loan:
    """One owner's loan as the trainer receives it (the load stage's output): ``rows`` of the
    keys not ``held``, in key order; the ``held`` keys' rows are the trainer's own."""

    rows: npt.NDArray[np.float32]
    held: npt.NDArray[np.bool_] | None = None

    @property
    def shipped(self) -> int:
        return int(self.rows.shape[0])

    @property
    def kept(self) -> int:
        return 0 if self.held is None else int(np.count_nonzero(self.held))


@dataclass(frozen=True)
class Refresh:
    """Rows an owner sends again because another borrower changed them since they were lent."""

    keys: npt.NDArray[np.uint64]
    rows: npt.NDArray[np.float32]
