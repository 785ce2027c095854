"""First-order rows: a width-1 table over slots that another table holds too (issue 42).

DeepFM and Wide & Deep need, per key, a first-order weight ``w_i`` beside its embedding ``v_i``.
They are held as rows of their own: a table named :data:`FIRST_ORDER` of ``dim = 1`` whose
:class:`~hpsray.tables.TableSpec` is a *copy* (``copy = True``): its slots are slots of the data
that a primary table holds as well. Each key of a copied slot is looked up in both tables.

**Model slots.** A source of ``n`` slots feeds a model of ``n + c`` slots, ``c`` the copied slots:
slots ``0 .. n-1`` are the data's, slot ``n + j`` is the ``j``-th copied slot (copy tables in
order, each in its slots' order). :func:`expand` makes a batch so (each example's keys, then its
copies' keys); :class:`~hpsray.tables.TagKeys` runs it before tagging, so every reader, the
reference trainer and serving see the same model slots, and the copies' keys carry the copy
table's tag: a key of the first-order table never meets its embedding row's key.

**Binding.** :func:`~hpsray.tables.with_first_order` adds the first-order table to a config whose
``model_kind`` needs it (:data:`FIRST_ORDER_KINDS`): the job's tables (or the one default table
of every slot) plus the copy of every slot at ``dim = 1``, with the job's sparse optimizer and
learning rate. It is idempotent, and runs where a config meets its source's slot count
(:meth:`Tables.of <hpsray.tables.Tables.of>`, the pipeline, the engine, the reference trainer,
the job file), so every tier, trainer, checkpoint and export holds the first-order rows as one
more table. This module imports nothing of :mod:`hpsray.tables`, which builds on it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hpsray.data.batch import Batch

__all__ = ["FIRST_ORDER", "FIRST_ORDER_KINDS", "expand", "needs_first_order"]

FIRST_ORDER = "first_order"
"""The name of the first-order table :func:`~hpsray.tables.with_first_order` adds (reserved: a
job's table may not take it)."""
FIRST_ORDER_KINDS = ("deepfm", "wide_deep")
"""The model kinds whose keys need a first-order weight of their own."""


def needs_first_order(config: Any) -> bool:
    """Whether ``config``'s model kind takes first-order rows."""
    return getattr(config, "model_kind", "mlp") in FIRST_ORDER_KINDS


def expand(batch: Batch, copy_of: np.ndarray) -> Batch:
    """``batch`` (of the data's ``n`` slots) with the copied slots appended: per example its keys,
    then the keys of its slots ``copy_of[j]`` as slot ``n + j`` (``copy_of``: the data slot of each
    copied slot, in model-slot order). Vector code only; the keys are not tagged here."""
    n = batch.n_slots
    if copy_of.size == 0:
        return batch
    by_slot = np.argsort(copy_of, kind="stable")  # copied slots grouped by the data slot they copy
    first = np.searchsorted(copy_of[by_slot], np.arange(n + 1))  # per data slot, its first copy there
    take = (first[1:] - first[:-1])[batch.slots]  # how many copies each key makes
    example = batch.example_of_key()
    src = np.repeat(np.arange(batch.nnz, dtype=np.int64), take)
    rank = np.arange(src.size, dtype=np.int64) - np.repeat(np.cumsum(take) - take, take)
    new_slot = n + by_slot[first[batch.slots[src]] + rank]
    # each example: its own keys, then its copies (scattered to their places: no sort)
    own = np.diff(batch.offsets)
    of_copy = example[src]
    made = np.bincount(of_copy, minlength=len(batch))
    offsets = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(own + made, out=offsets[1:])
    at_own = offsets[example] + np.arange(batch.nnz, dtype=np.int64) - batch.offsets[example]
    at_copy = offsets[of_copy] + own[of_copy] + np.arange(src.size, dtype=np.int64) - (np.cumsum(made) - made)[of_copy]
    keys = np.empty(batch.nnz + src.size, dtype=np.uint64)
    slots = np.empty(keys.size, dtype=np.int32)
    keys[at_own], keys[at_copy] = batch.keys, batch.keys[src]
    slots[at_own], slots[at_copy] = batch.slots, new_slot
    return replace(batch, keys=keys, offsets=offsets, slots=slots, n_slots=n + int(copy_of.size))
