"""HBM-PS of several widths (issue 43): the trainer's working set holds each row group's rows in
its own table at the group's width, and answers borrow, get and find as one table of padded rows
does (the oracle: :class:`HbmPS` at the padded width)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.kernels.init import initial_rows
from hpsray.tables import TableSpec, TagKeys, tag_keys
from hpsray.tiers.grouped_hbm import GroupedHbmPS
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.loans import Loan
from hpsray.tiers.padded import pad, split
from hpsray.tiers.rowgroups import RowGroups
from hpsray.training.engine import TrainerEngine

THREE = (
    TableSpec("small", (0, 2), 4),
    TableSpec("lists", (1,), 16, "mean"),
    TableSpec("ids", (3,), 8, optimizer="adam", lr=0.01),
)
CONFIG = TrainConfig(dim=4, hidden=(8,), minibatch_size=32, sparse_optimizer="adagrad", tables=THREE)
GROUPS = RowGroups.of(CONFIG.tables_for(4))
WIDTH = CONFIG.row_width


def keys_of(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.choice(1 << 40, n, replace=False).astype(np.uint64)
    return tag_keys(raw, rng.integers(0, 4, n), CONFIG.tables_for(4).slot_table)


def padded_rows(keys: np.ndarray, seed: int) -> np.ndarray:
    """Random rows of ``keys`` at the padded width, zeros past each key's group's width."""
    rows = np.random.default_rng(seed).standard_normal((keys.size, WIDTH)).astype(np.float32)
    return pad(split(GROUPS, keys, rows), keys.size, WIDTH)


def test_each_group_is_held_at_its_width_and_answers_as_one_padded_table():
    grouped = GroupedHbmPS(GROUPS, 60, CONFIG.row_init(), WIDTH)  # small: the tables grow
    oracle = HbmPS(60, WIDTH, CONFIG.row_init())
    first, second = keys_of(300, 1), keys_of(300, 2)
    for ws in (grouped, oracle):
        assert ws.borrow(first, padded_rows(first, 3)) == 0
    # the next batch: half of the first's keys resident (held, not shipped), half new; a
    # refreshed row outside both; the first's other keys stale
    keys = np.sort(np.concatenate([first[:150], second[:150]]))
    held = np.isin(keys, first)
    rows = padded_rows(keys[~held], 4)
    fresh_keys = second[150:160]
    fresh = [(fresh_keys, padded_rows(fresh_keys, 5))]
    stale = first[150:]
    hits = [ws.borrow(keys, rows, fresh, held, stale) for ws in (grouped, oracle)]
    assert hits[0] == hits[1] == 150
    assert grouped.size == oracle.size == 310
    everything = np.concatenate([keys, fresh_keys])
    np.testing.assert_array_equal(grouped.get(everything), oracle.get(everything))
    assert [t.width for t in grouped.tables] == list(GROUPS.widths) == [8, 32, 24]
    assert grouped.grown > 0  # each table started at a third of 60 rows
    # find: global slots, each group's within its bounds, addressing the group's own rows
    slots = grouped.find(everything)
    bases = grouped.bases
    for g, at in enumerate(GROUPS.split(everything)):
        assert np.all((slots[at] >= bases[g]) & (slots[at] < bases[g + 1]))
        rows_g = np.asarray(grouped.tables[g].rows)[slots[at] - bases[g]]
        np.testing.assert_array_equal(rows_g, oracle.get(everything[at])[:, : GROUPS.widths[g]])
    assert grouped.find(keys_of(5, 9)).tolist() == [-1] * 5
    assert grouped.retain(keys) == 10 and grouped.size == 300


def test_a_held_key_not_resident_is_refused_naming_it():
    grouped = GroupedHbmPS(GROUPS, 64, CONFIG.row_init(), WIDTH)
    keys = keys_of(20, 6)
    with pytest.raises(Exception, match="resident|held"):
        grouped.borrow(keys, np.zeros((0, WIDTH), np.float32), held=np.ones(20, bool))


def test_the_trainers_working_set_holds_rows_at_their_tables_widths():
    """The engine's working set: one table per group at its width (bytes per row of the dim-4
    table are its 8 floats, not the widest group's 32), and a step updates rows in place there."""
    gen = PlantedCTR(n_slots=4, keys_per_slot=80, nnz_per_slot=PlantedCTR.spread_nnz(4, 6), n_dense=2, seed=3)
    tables = CONFIG.tables_for(4)
    batch = TagKeys(tables)(gen.generate(128))
    engine = TrainerEngine(CONFIG, 4, 2, capacity=1000)
    keys = np.unique(batch.keys)
    rows = np.zeros((keys.size, WIDTH), np.float32)
    table = tables.table_of(keys)
    for t in range(len(tables)):
        at = np.flatnonzero(table == t)
        rows[at, : tables.widths[t]] = initial_rows(keys[at], tables.widths[t], tables.row_inits[t])
    engine.borrow(0, [keys], [Loan(rows)])
    assert [t.width for t in engine.hbm.tables] == [8, 32, 24]
    before = [torch.as_tensor(np.asarray(t.rows)).clone() for t in engine.hbm.tables]
    engine.close_batch(engine.train_local(engine.index(batch)))
    after = engine.rows(keys)
    assert not np.array_equal(after, rows)  # trained, in each group's own table
    for g, at in enumerate(GROUPS.split(keys)):
        w = GROUPS.widths[g]
        assert not np.any(after[at, w:])  # returned padded: zeros past the group's width
        assert not torch.equal(before[g], torch.as_tensor(np.asarray(engine.hbm.tables[g].rows)))


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_the_grouped_step_gathers_and_updates_each_groups_rows_in_any_slot_order(order):
    """A mini-batch's slots come sorted from the trainer's own index (each group a range) and in
    key order from the read stage's (positions): both give the bits of each group stepped alone
    with its optimizer in its own arena."""
    from hpsray.training.grouped_step import GroupedArenaStep
    from hpsray.training.sparse_update import update_rows

    tables = CONFIG.tables_for(4)
    optimizers = [tables.optimizers[ts[0]] for ts in GROUPS.tables]
    sizes = [50, 40, 30]
    bases = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    rng = np.random.default_rng(4)
    arenas = [torch.as_tensor(rng.random((n, w), dtype=np.float32)) for n, w in zip(sizes, GROUPS.widths, strict=True)]
    want = [a.clone() for a in arenas]
    step = GroupedArenaStep(arenas, bases, GROUPS, optimizers)
    slots = torch.as_tensor(np.sort(rng.choice(bases[-1], 60, replace=False)))
    if order == "shuffled":
        slots = slots[torch.as_tensor(rng.permutation(60))]
    grads = torch.as_tensor(rng.standard_normal((60, step.dim), dtype=np.float32))
    gathered = step.gather(slots)
    for i, s in enumerate(slots.tolist()):
        g = int(np.searchsorted(bases, s, side="right")) - 1
        w = GROUPS.widths[g]
        assert torch.equal(gathered[i, :w], want[g][s - bases[g]]) and not gathered[i, w:].any()
    step.update(slots, gathered, grads, 3)
    for g, (base, d) in enumerate(zip(bases, GROUPS.dims, strict=False)):
        mine = ((slots >= base) & (slots < bases[g + 1])).nonzero().squeeze(1)
        rows = want[g][slots[mine] - base]
        update_rows(rows, grads[mine, :d], optimizers[g], 3)
        want[g][slots[mine] - base] = rows
        assert torch.equal(arenas[g], want[g]), g
