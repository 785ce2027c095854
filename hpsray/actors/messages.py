"""The messages between the stage actors and the driver, one dataclass each.

Refs travel inside these messages unresolved (Ray resolves only top-level arguments), so each
actor fetches exactly the parts it needs: a MEM-PS gets one owner's keys, never the batch.

Per batch ``t`` (docs/architecture.md: The pipeline)::

    Reader.read            -> ReadBatch      (the batch and its keys split by owner, as refs)
    MemPSShard.pull        -> Pulled         (a loan: the rows the owner holds, the keys it lacks)
    SSDPSShard.load_missing(Pulled) -> Loan  (the owner's rows of the borrower's keys it does not hold)
    MemPSShard.refresh     -> Refresh        (rows other borrowers changed since the loan)
    Trainer.train(TrainInputs) -> Returned per owner, then TrainOutcome
    MemPSShard.write_back(*Returned)
    Trainer.flush -> [Returned per owner]  (rows it kept across a batch end: before a checkpoint,
    MemPSShard.store_kept(*flushed)        at a stop, after a failure)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpsray.tiers.loans import Loan, Pulled, Refresh, Returned

__all__ = ["Loan", "Pulled", "ReadBatch", "Refresh", "Returned", "TrainInputs", "TrainOutcome"]


@dataclass(frozen=True)
class ReadBatch:
    """A reader's next batch: ``examples == 0`` (and ``batch`` a ref to ``None``) at the end.

    ``batch`` and each of ``keys_by_owner`` (the batch's distinct sorted keys owned by node
    ``o``) are object refs.
    """

    examples: int
    batch: Any
    keys_by_owner: list[Any]


@dataclass(frozen=True)
class TrainInputs:
    """What a trainer needs for one batch, as refs it resolves itself.

    ``keys[o]`` and ``loans[o]`` are the keys and rows owner ``o`` lent (``loans[o]``: the load
    stage's output, ``SSDPSShard.load_missing``, on ``o``'s node); ``refreshed[o]`` (empty
    on one node and for a pass's first batch) its :class:`Refresh`. ``sizes`` holds every node's
    examples in this batch: all trainers step through the same number of global mini-batches.
    ``next_batch``: this node's :class:`ReadBatch` (or a ref to it) of the batch after, when the
    trainer may keep the rows both batches need instead of returning them (``None``: return
    them all); ``must_return[o]`` (several nodes: refs, one per owner) the keys owner ``o``
    needs back all the same.
    """

    batch: Any
    keys: list[Any]
    loans: list[Any]
    refreshed: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    next_batch: Any = None
    must_return: list[Any] = field(default_factory=list)

    def refs(self) -> list[Any]:
        """Every ref, in the order :meth:`unpack` expects their values."""
        return [self.batch, *self.keys, *self.loans, *self.refreshed]

    def unpack(self, values: list[Any]) -> tuple[Any, list, list, list]:
        """``(batch, keys, loans, refreshed)`` from the values of :meth:`refs`."""
        n, m = len(self.keys), len(self.refreshed)
        return values[0], values[1 : 1 + n], values[1 + n : 1 + 2 * n], values[1 + 2 * n : 1 + 2 * n + m]


@dataclass(frozen=True)
class TrainOutcome:
    """A trainer's result of one batch: mean loss over its mini-batches and its examples."""

    loss: float
    examples: int
