"""The batch's index on the CPU (:mod:`hpsray.kernels.batch_index`: two passes, no sort) is the
index the torch ops make around their sort (:func:`index_batch_sorted`, the path off the CPU),
array for array: so the step reads, pools and sums exactly what it did."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpsray.data.batch import Batch
from hpsray.kernels.batch_index import SCRATCH_ROWS_PER_OCCURRENCE, index_slots
from hpsray.training import layout as layout_module
from hpsray.training.layout import BatchIndex, index_batch, index_batch_sorted

CPU = torch.device("cpu")


def _batch(rng: np.random.Generator, n: int, n_slots: int, n_keys: int, max_per_bag: int) -> Batch:
    """Examples of 0..max_per_bag keys per slot, slots ascending within an example (bag order),
    keys repeated within and across bags, some examples empty."""
    keys, slots, offsets = [], [], [0]
    for _ in range(n):
        per_slot = rng.integers(0, max_per_bag + 1, n_slots) * (rng.random() > 0.1)
        for s, c in enumerate(per_slot):
            keys += rng.integers(1, n_keys + 1, c).tolist()
            slots += [s] * int(c)
        offsets.append(len(keys))
    return Batch(
        labels=rng.random(n).astype(np.float32),
        dense=rng.random((n, 3)).astype(np.float32),
        keys=np.array(keys, np.uint64),
        offsets=np.array(offsets, np.int64),
        slots=np.array(slots, np.int32),
        n_slots=n_slots,
    )


def _find_of(slot_of: np.ndarray):
    def find(keys: np.ndarray, on_device: torch.Tensor | None) -> torch.Tensor:
        return torch.from_numpy(slot_of[keys.astype(np.int64)])

    return find


def _assert_same(a: BatchIndex, b: BatchIndex) -> None:
    assert a.bounds == b.bounds and a.n_examples == b.n_examples and len(a) == len(b)
    assert torch.equal(a.rows, b.rows)
    for x, y in zip(a.minibatches, b.minibatches, strict=True):
        for name in ("rows", "keys", "inverse", "bag_offsets", "grad_bags", "grad_offsets", "dense", "labels"):
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None), name
            if u is not None:
                assert u.dtype == v.dtype and torch.equal(u, v), name
        assert (x.n_examples, x.n_slots) == (y.n_examples, y.n_slots)


def _assert_kernel_is(batch: Batch, m: int, slots: np.ndarray, capacity: int, sort: BatchIndex) -> None:
    """``index_slots`` gives the arrays of the sorted index ``sort``."""
    ix = index_slots(slots, batch.offsets, batch.slots, batch.n_slots, m, capacity)
    assert tuple(ix["bounds"].tolist()) == sort.bounds
    np.testing.assert_array_equal(ix["rows"], sort.rows.numpy())
    for k, mb in enumerate(sort.minibatches):
        lo, hi = batch.offsets[k * m], batch.offsets[min((k + 1) * m, len(batch))]
        g0, g1 = sort.bounds[k], sort.bounds[k + 1]
        np.testing.assert_array_equal(ix["inverse"][lo:hi], mb.inverse.numpy())
        np.testing.assert_array_equal(ix["grad_bags"][lo:hi], mb.grad_bags.numpy())
        np.testing.assert_array_equal(ix["grad_offsets"][g0:g1], mb.grad_offsets.numpy())
        np.testing.assert_array_equal(
            ix["bag_start"][k * m * batch.n_slots :][: mb.bag_offsets.numel()], mb.bag_offsets
        )
        if mb.keys is not None:  # each row's key: its first occurrence's
            np.testing.assert_array_equal(batch.keys[ix["first"][g0:g1]].view(np.int64), mb.keys.numpy())


@pytest.mark.parametrize(
    ("seed", "n", "m", "n_keys", "capacity"),
    [
        (0, 37, 8, 40, 300),  # a short last mini-batch
        (1, 64, 64, 500, 600),  # one mini-batch
        (2, 50, 1, 30, 31),  # mini-batches of one example; the top slot is capacity - 1
        (3, 20, 100, 1000, 5_000_000),  # rows sparse in a large working set (the bitmap's words)
        (4, 200, 16, 5, 200),  # five keys: every row in many bags of a mini-batch
    ],
)
@pytest.mark.parametrize("with_keys", [False, True])
def test_the_cpu_kernel_lays_out_a_batch_as_the_sort_does(seed, n, m, n_keys, capacity, with_keys):
    rng = np.random.default_rng(seed)
    batch = _batch(rng, n, n_slots=5, n_keys=n_keys, max_per_bag=3)
    slot_of = rng.permutation(capacity)[: n_keys + 1]  # any injective map of keys to slots
    slot_of[np.argmax(slot_of)] = capacity - 1
    find = _find_of(slot_of)
    sort = index_batch_sorted(batch, m, find, capacity, CPU, with_keys)
    _assert_kernel_is(batch, m, slot_of[batch.keys.astype(np.int64)], capacity, sort)
    _assert_same(index_batch(batch, m, find, capacity, CPU, with_keys), sort)  # whichever path it takes


def test_the_kernel_runs_on_the_cpu_and_the_sort_on_batches_out_of_bag_order(monkeypatch):
    rng = np.random.default_rng(5)
    batch = _batch(rng, 30, n_slots=4, n_keys=50, max_per_bag=2)
    find = _find_of(rng.permutation(100))
    expected = index_batch_sorted(batch, 8, find, 100, CPU)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return expected

    monkeypatch.setattr(layout_module, "index_batch_sorted", counted)
    _assert_same(index_batch(batch, 8, find, 100, CPU), expected)
    assert not calls  # in bag order: the kernel, no sort
    swapped = Batch(batch.labels, batch.dense, batch.keys, batch.offsets, batch.slots[::-1].copy(), batch.n_slots)
    index_batch(swapped, 8, find, 100, CPU)
    assert len(calls) == 1  # an example's slots descending: the sort puts them in bag order
    huge = SCRATCH_ROWS_PER_OCCURRENCE * batch.nnz + 2**16 + 1
    index_batch(batch, 8, find, huge, CPU)
    assert len(calls) == 2  # a working set far larger than the batch: the kernel's scratch would cost more


def test_a_slot_outside_the_working_set_is_an_error_not_a_stray_write():
    rng = np.random.default_rng(6)
    batch = _batch(rng, 10, n_slots=3, n_keys=20, max_per_bag=2)
    slot_of = np.arange(21, dtype=np.int64) + 10  # slots up to 30
    with pytest.raises(ValueError, match=r"outside \[0, 25\)"):
        index_batch(batch, 4, _find_of(slot_of), 25, CPU)
