"""Tables of their own width and sparse optimizer in the trainer's engine (issue 43): the working
set holds rows of three layouts, each steps with its own optimizer at its own dim, and the result
is the reference trainer's to the bit (one node) or within the allreduce's rounding (BSP)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inprocess import ThreadGroup, run_ranks  # tests/training/inprocess.py

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.data.batch import Batch
from hpsray.kernels.init import initial_rows
from hpsray.reference import ReferenceTrainer
from hpsray.tables import Tables, TableSpec, TagKeys
from hpsray.tiers.loans import Loan
from hpsray.training.engine import TrainerEngine
from hpsray.training.strategies import BspSteps

GEN = PlantedCTR(n_slots=4, keys_per_slot=120, nnz_per_slot=PlantedCTR.spread_nnz(4, 10), n_dense=3, seed=11)
# the mix: a dim-4 sum table (the job's Adagrad), a dim-16 mean table of multi-hot lists,
# a dim-8 table with its own Adam learning rate
THREE = (
    TableSpec("small", (0, 2), 4),
    TableSpec("lists", (1,), 16, "mean"),
    TableSpec("ids", (3,), 8, optimizer="adam", lr=0.02),
)


def config(tables=THREE, **kw) -> TrainConfig:
    base = dict(dim=4, hidden=(16, 8), minibatch_size=64, sparse_optimizer="adagrad", dense_optimizer="adam")
    return TrainConfig(**{**base, **kw}, tables=tables)


class Owner:
    """Every row in a dict at its table's width; lent padded to the working set's width."""

    def __init__(self, tables: Tables, width: int) -> None:
        self.tables, self.width, self.rows = tables, width, {}

    def lend(self, keys: np.ndarray) -> Loan:
        out = np.zeros((keys.size, self.width), np.float32)
        table = self.tables.table_of(keys)
        for t in range(len(self.tables)):
            at = np.flatnonzero(table == t)
            w = self.tables.widths[t]
            out[at, :w] = initial_rows(keys[at], w, self.tables.row_inits[t])
        for i, k in enumerate(keys.tolist()):
            if k in self.rows:
                out[i] = self.rows[k]
        return Loan(out)

    def write_back(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self.rows.update((k, r.copy()) for k, r in zip(keys.tolist(), rows, strict=True))

    def table_rows(self, name: str, keys: np.ndarray) -> np.ndarray:
        t = self.tables.names().index(name)
        return np.stack([self.rows[k][: self.tables.widths[t]] for k in keys.tolist()])


def _check_against(reference: ReferenceTrainer, owner: Owner, engine: TrainerEngine, exact: bool) -> None:
    for name, (keys, want) in reference.export_tables().items():
        got = owner.table_rows(name, keys)
        if exact:
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=name)
    for t, width in enumerate(owner.tables.widths):  # the padding past a row's width stays zero
        pad = [r[width:] for k, r in owner.rows.items() if (k >> 56) == t]
        assert not np.any(pad), owner.tables.names()[t]


@pytest.mark.parametrize("sparse", ["adagrad", "sgd", "adagrad_row"])
def test_three_layouts_train_to_the_references_bits(sparse):
    cfg = config(sparse_optimizer=sparse)
    tables = cfg.tables_for(GEN.n_slots)
    tag = TagKeys(tables)
    batches = [GEN.generate(300, start_row=300 * i) for i in range(4)]
    reference = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)
    expected = [reference.train_batch(b) for b in batches]
    engine = TrainerEngine(cfg, GEN.n_slots, GEN.n_dense, capacity=4000)
    assert engine.groups is not None and engine.groups.widths[2] == 24  # dim 8 + Adam's two
    owner = Owner(tables, engine.row_width)
    losses = []
    for b in batches:
        batch = tag(b)
        keys = np.unique(batch.keys)
        engine.borrow(0, [keys], [owner.lend(keys)])
        losses.append(engine.close_batch(engine.train_local(engine.index(batch))))
        owner.write_back(keys, engine.rows(keys))
    _check_against(reference, owner, engine, exact=True)
    model, state = engine.dense.models[0].state_dict(), reference.dense_state()
    for name, value in state.items():
        assert torch.equal(model[name], value), name
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    held_out = tag(GEN.generate(200, start_row=9000))
    keys = np.unique(held_out.keys)
    lent = owner.lend(keys).rows
    np.testing.assert_allclose(
        engine.predict(held_out, keys, lent), reference.predict(GEN.generate(200, start_row=9000)), rtol=1e-6
    )


def test_one_table_stepped_with_another_tables_optimizer_is_caught():
    """The guard: the group's own optimizer matters (the ids table's rows stepped by the first
    group's Adagrad instead of its Adam differ from the reference)."""
    cfg = config()
    tables = cfg.tables_for(GEN.n_slots)
    tag = TagKeys(tables)
    batches = [GEN.generate(200, start_row=200 * i) for i in range(2)]
    reference = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)
    for b in batches:
        reference.train_batch(b)
    engine = TrainerEngine(cfg, GEN.n_slots, GEN.n_dense, capacity=4000)
    engine.group_optimizers = (engine.group_optimizers[0],) * 3  # the fault
    owner = Owner(tables, engine.row_width)
    for b in batches:
        batch = tag(b)
        keys = np.unique(batch.keys)
        engine.borrow(0, [keys], [owner.lend(keys)])
        engine.close_batch(engine.train_local(engine.index(batch)))
        owner.write_back(keys, engine.rows(keys))
    with pytest.raises(AssertionError, match="not equal"):  # every table: the dense model follows
        _check_against(reference, owner, engine, exact=True)


def test_two_engines_under_bsp_train_three_layouts_as_the_reference():
    cfg = config(sparse_optimizer="adagrad", dense_optimizer="sgd")
    tables = cfg.tables_for(GEN.n_slots)
    tag = TagKeys(tables)
    shares = [[GEN.generate(200, start_row=1000 * t + 400 * r) for t in range(3)] for r in range(2)]
    m = cfg.minibatch_size
    reference = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)
    for parts in zip(*shares, strict=True):
        steps = max(-(-len(p) // m) for p in parts)
        reference.train_minibatches([Batch.concat([p.slice(k * m, (k + 1) * m) for p in parts]) for k in range(steps)])
    group = ThreadGroup(2)
    engines = [TrainerEngine(cfg, GEN.n_slots, GEN.n_dense, capacity=4000, n_nodes=2) for _ in range(2)]
    members = [group.member(r) for r in range(2)]
    strategies = [BspSteps(e, mm, mm.allreduce_sum) for e, mm in zip(engines, members, strict=True)]
    owner = Owner(tables, engines[0].row_width)

    def run(rank: int, t: int) -> None:
        batch, engine = tag(shares[rank][t]), engines[rank]
        keys = np.unique(batch.keys)
        engine.borrow(t, [keys], [owner.lend(keys)])
        try:
            engine.close_batch(strategies[rank].steps(engine.index(batch), [200, 200]))
        except BaseException:
            group.barrier.abort()
            raise

    for t in range(3):
        run_ranks(2, lambda rank, t=t: run(rank, t))
        for engine, batch in zip(engines, (shares[0][t], shares[1][t]), strict=True):
            keys = np.unique(tag(batch).keys)
            owner.write_back(keys, engine.rows(keys))
    _check_against(reference, owner, engines[0], exact=False)
