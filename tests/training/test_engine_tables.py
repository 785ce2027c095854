"""Tables of their own in the trainer's engine on several nodes (BSP, engines in threads): the
other node's updates land with each table's learning rate and pooling (tests/tables has the rest)."""

from __future__ import annotations

import numpy as np
from inprocess import ThreadGroup, run_ranks  # tests/training/inprocess.py

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.data.batch import Batch
from hpsray.kernels.init import initial_rows
from hpsray.reference import ReferenceTrainer
from hpsray.tables import TableSpec, TagKeys
from hpsray.tiers.loans import Loan
from hpsray.training.engine import TrainerEngine
from hpsray.training.strategies import BspSteps

GEN = PlantedCTR(n_slots=4, keys_per_slot=80, nnz_per_slot=PlantedCTR.spread_nnz(4, 9), n_dense=3, seed=7)
TABLES = (TableSpec("a", (0, 2), 4), TableSpec("lists", (1,), 4, "mean"), TableSpec("ids", (3,), 4, lr=0.2))


def test_two_engines_under_bsp_apply_each_tables_learning_rate_to_every_nodes_update():
    """Two nodes as two engines in threads (BSP): updates from the other node land on a row
    with its own table's learning rate and pooling; the result is the reference's."""

    cfg = TrainConfig(
        dim=4, hidden=(8,), minibatch_size=64, tables=TABLES, sparse_optimizer="sgd", dense_optimizer="sgd"
    )
    tag = TagKeys(cfg.tables_for(GEN.n_slots))
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
    store: dict[int, np.ndarray] = {}

    def run(rank: int, t: int) -> None:
        batch, engine = tag(shares[rank][t]), engines[rank]
        keys = np.unique(batch.keys)
        rows = initial_rows(keys, cfg.row_width, cfg.row_init())
        for i, k in enumerate(keys.tolist()):
            if k in store:
                rows[i] = store[k]
        engine.borrow(t, [keys], [Loan(rows)])
        try:
            engine.close_batch(strategies[rank].steps(engine.index(batch), [200, 200]))
        except BaseException:
            group.barrier.abort()  # the other rank waits no longer
            raise

    for t in range(3):
        run_ranks(2, lambda rank, t=t: run(rank, t))
        for engine, batch in zip(engines, (shares[0][t], shares[1][t]), strict=True):
            keys = np.unique(tag(batch).keys)
            store.update((k, r.copy()) for k, r in zip(keys.tolist(), engine.rows(keys), strict=True))
    for name, (keys, want) in reference.export_tables().items():
        np.testing.assert_allclose(
            np.stack([store[k] for k in keys.tolist()]), want, rtol=1e-5, atol=1e-7, err_msg=name
        )
