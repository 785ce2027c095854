"""The batch's index made by the read stage (``index_positions``: over the positions of the
keys borrowed, mapped to the trainer's slots by one gather) trains the same bits as the index
the trainer makes itself (one probe of every occurrence, one sort), on one node and across two."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paths import MINIBATCH, path  # tests/training/paths.py

from hpsray.data import PlantedCTR
from hpsray.tiers.partition import owner_of
from hpsray.training import engine as engine_module
from hpsray.training.layout import ALIGN, index_positions, positions_of


def _run(name: str, optimizer: str, layouts: bool) -> tuple[list, list]:
    returned: list = []
    go, strategies = path(name, optimizer, layouts=layouts, returned=returned)
    go()
    dense = [[p.detach().clone() for p in s.engine.dense.models[0].parameters()] for s in strategies]
    return sorted(returned, key=lambda r: (r[0], r[1])), dense


@pytest.mark.parametrize(("name", "optimizer"), [("local", "adagrad"), ("local", "adam"), ("bsp", "adagrad_row")])
def test_a_layout_made_by_the_read_stage_trains_the_same_bits(name, optimizer, monkeypatch):
    mine, mine_dense = _run(name, optimizer, layouts=False)

    def not_here(*args, **kwargs):
        raise AssertionError("the trainer indexed a batch that came with its layout")

    monkeypatch.setattr(engine_module, "index_batch", not_here)  # given a layout, the trainer only maps it
    read, read_dense = _run(name, optimizer, layouts=True)
    assert len(mine) == len(read) >= 2
    for (b0, r0, a), (b1, r1, b) in zip(mine, read, strict=True):
        assert (b0, r0) == (b1, r1) and a.loss == b.loss and a.examples == b.examples
        for (ka, rows_a), (kb, rows_b) in zip(a.returned, b.returned, strict=True):
            np.testing.assert_array_equal(ka, kb)
            np.testing.assert_array_equal(rows_a, rows_b)
    for pa, pb in zip(mine_dense, read_dense, strict=True):
        for x, y in zip(pa, pb, strict=True):
            assert torch.equal(x, y)


def test_a_layout_names_each_occurrence_by_its_keys_position():
    batch = PlantedCTR(n_slots=4, keys_per_slot=50, n_dense=2, seed=1).generate(300)
    parts, positions = positions_of(batch.keys, 2)
    keys = np.unique(batch.keys)
    owners = owner_of(keys, 2)
    for o in range(2):  # the parts the reader hands the owners: each owner's keys, sorted
        np.testing.assert_array_equal(parts[o], keys[owners == o])
    together = np.concatenate(parts)
    np.testing.assert_array_equal(together[positions], batch.keys)
    layout = index_positions(batch, MINIBATCH, positions, together.size)
    slots = torch.from_numpy(np.random.default_rng(0).permutation(together.size).astype(np.int64))
    index = layout.at_slots(slots, torch.from_numpy(together.view(np.int64)), torch.device("cpu"))
    by_slot = dict(zip(slots.numpy(), together, strict=True))
    for k, mb in enumerate(index.minibatches):
        part = batch.slice(k * MINIBATCH, (k + 1) * MINIBATCH)
        assert mb.keys is not None
        assert sorted(mb.keys.numpy().view(np.uint64)) == sorted(np.unique(part.keys))  # its distinct keys
        assert [by_slot[s] for s in mb.rows.numpy()] == list(mb.keys.numpy().view(np.uint64))


@pytest.mark.parametrize("how", ["packed", "staged"])
def test_the_packed_upload_gives_the_same_index(how):
    """``at_slots(pack=True)`` (off the CPU by default: two buffers instead of a copy per array)
    and a layout staged ahead for a device (``staged``: those buffers put together before the
    batch's turn; here for a device other than the CPU, then read on it) give every mini-batch
    the same arrays as one copy per array; each array starts aligned in its buffer."""
    batch = PlantedCTR(n_slots=4, keys_per_slot=50, n_dense=3, seed=2).generate(1000)
    parts, positions = positions_of(batch.keys, 2)
    together = np.concatenate(parts)
    layout = index_positions(batch, MINIBATCH, positions, together.size)
    slots = torch.from_numpy(np.random.default_rng(1).permutation(together.size).astype(np.int64))
    keys = torch.from_numpy(together.view(np.int64))
    plain = layout.at_slots(slots, keys, torch.device("cpu"), pack=False)
    if how == "staged":
        assert layout.staged(torch.device("cpu")) is layout  # on the CPU: nothing to stage
        layout = layout.staged(torch.device("meta"))
        assert layout.staging is not None and not layout.staging.pinned
        spans = layout.staging.int_spans + layout.staging.float_spans
        assert len(spans) == 1 + 6 * len(layout) and all(start % ALIGN == 0 for start, _ in spans)
        packed = layout.at_slots(slots, keys, torch.device("cpu"))  # the staged buffers, by default
    else:
        packed = layout.at_slots(slots, keys, torch.device("cpu"), pack=True)
    assert len(plain) == len(packed) >= 3 and packed.bounds == plain.bounds
    assert torch.equal(packed.rows, plain.rows)
    for a, b in zip(plain.minibatches, packed.minibatches, strict=True):
        for name in ("rows", "keys", "inverse", "bag_offsets", "grad_bags", "grad_offsets", "dense", "labels"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert (a.n_examples, a.n_slots) == (b.n_examples, b.n_slots)
