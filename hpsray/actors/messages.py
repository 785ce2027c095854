"""The messages between the stage actors and the driver: the protocol's spec, one dataclass each.

Layering: the loan's four (``Pulled``, ``Loan``, ``Refresh``, ``Returned``) are defined in the
Ray-free :mod:`hpsray.tiers.loans` and re-exported here, since two engines (the owner's and the
trainer's) build and read them and engines never import this package; so is a device process's
``DevicePart`` (:mod:`hpsray.training.part`, built by the device strategy). The three that
carry refs are defined here, Ray-free too (refs are typed for mypy only).

Refs travel inside these messages unresolved (Ray resolves only top-level arguments), so each
actor fetches exactly the parts it needs: a MEM-PS gets one owner's keys, never the batch.

Per batch ``t`` (docs/architecture.md: The pipeline; the verbs: Glossary)::

    Reader.read                      -> ReadBatch   (the batch and its keys split by owner, as refs)
    MemPSShard.pull                  -> Pulled      (a loan: the rows the owner holds, the keys it lacks)
    SSDPSShard.load_missing(Pulled)  -> Loan        (the owner's rows of the borrower's keys it does not hold)
    MemPSShard.refresh               -> Refresh     (rows other borrowers changed since the loan)
    MemPSShard.must_return           -> keys        (several nodes: what a trainer returns though it keeps it)
    Trainer.train(TrainInputs)       -> TrainOutcome
    Trainer.returned(batch id)       -> Returned per owner                      (TrainReturns)
    Trainer.train_part(TrainInputs)  -> DevicePart  (D > 1 devices: device d's part, to device 0)
    MemPSShard.write_back(*Returned)
    Trainer.flush                    -> [Returned per owner]  (rows it kept across a batch end: before a
    MemPSShard.store_kept(*flushed)                              checkpoint, at a stop, after a failure)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hpsray.tiers.loans import Loan, Pulled, Refresh, Returned
from hpsray.training.part import DevicePart

if TYPE_CHECKING:
    from ray import ObjectRef

    from hpsray.data.batch import Batch
    from hpsray.training.layout import BatchIndex

__all__ = [
    "DevicePart",
    "Loan",
    "Pulled",
    "ReadBatch",
    "Refresh",
    "Returned",
    "TrainData",
    "TrainInputs",
    "TrainOutcome",
    "TrainReturns",
]

Keys = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class ReadBatch:
    """A reader's next batch: ``examples == 0`` (and ``batch`` a ref to ``None``) at the end.
    ``keys_by_owner[o]``: the batch's distinct sorted keys owned by node ``o``; ``layout``
    (when the reader was given the mini-batch size): the batch's index over those keys'
    positions (``hpsray.training.layout.index_positions``), which the trainer maps to its slots."""

    examples: int
    batch: ObjectRef[Batch | None]
    keys_by_owner: list[ObjectRef[Keys]]
    layout: ObjectRef[BatchIndex] | None = None


@dataclass(frozen=True)
class TrainData:
    """The values of a :class:`TrainInputs`' refs (:meth:`TrainInputs.resolve`)."""

    batch: Batch | None
    keys: list[Keys]
    loans: list[Loan]
    refreshed: list[Refresh]
    layout: BatchIndex | None = None


@dataclass(frozen=True)
class TrainInputs:
    """What a trainer needs for one batch, as refs it resolves itself.

    ``keys[o]`` and ``loans[o]`` are the keys and rows owner ``o`` lent (``loans[o]``: the load
    stage's output, ``SSDPSShard.load_missing``, on ``o``'s node); ``refreshed[o]`` (empty
    on one node and for a pass's first batch) its :class:`Refresh`. ``sizes`` holds every node's
    examples in this batch: all trainers step through the same number of global mini-batches.
    ``next_batch``: a ref to this node's :class:`ReadBatch` of the batch after, when the trainer
    may keep the rows both batches need instead of returning them (``None``: return them all);
    ``must_return[o]`` (several nodes only) the keys owner ``o`` needs back all the same.
    """

    batch: ObjectRef[Batch | None]
    keys: list[ObjectRef[Keys]]
    loans: list[ObjectRef[Loan]]
    refreshed: list[ObjectRef[Refresh]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    next_batch: ObjectRef[ReadBatch] | None = None
    must_return: list[ObjectRef[Keys]] = field(default_factory=list)
    layout: ObjectRef[BatchIndex] | None = None

    def resolve(self, get: Callable[[list[ObjectRef[Any]]], list[Any]]) -> TrainData:
        """The values of ``batch``, ``keys``, ``loans`` and ``refreshed``, fetched in one call of
        ``get`` (``ray.get``, or a bounded one such as ``hpsray.cluster.faults.get``)."""
        layout = [self.layout] if self.layout is not None else []
        values = iter(get([self.batch, *self.keys, *self.loans, *self.refreshed, *layout]))
        batch = next(values)
        keys = [next(values) for _ in self.keys]
        loans = [next(values) for _ in self.loans]
        refreshed = [next(values) for _ in self.refreshed]
        return TrainData(batch=batch, keys=keys, loans=loans, refreshed=refreshed, layout=next(values, None))


@dataclass(frozen=True)
class TrainOutcome:
    """A trainer's result of one batch: mean loss over its mini-batches and its examples."""

    loss: float
    examples: int


TrainReturns = tuple["Returned", ...]
"""What ``Trainer.returned`` gives for several nodes: one :class:`Returned` per owner node (in
node order); Ray hands each out as its own ref (``num_returns = n_nodes``), so each owner's
write-back fetches only its rows."""
