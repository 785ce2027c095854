"""The trainer's engine without Ray: find once per batch, torch ops per mini-batch.

The reference trainer decides every result; on the CPU the engine equals it to the bit. The
``gpu`` cases run the same lines on a CUDA device (skipped elsewhere).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from budget import LAUNCHES, tally  # tests/training/budget.py
from inprocess import ThreadGroup  # tests/training/inprocess.py

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.data.batch import Batch
from hpsray.errors import MissingRowsError
from hpsray.kernels.init import initial_rows
from hpsray.models.pooling import BagLayout
from hpsray.reference import ReferenceTrainer
from hpsray.tiers.loans import Loan
from hpsray.training.engine import TrainerEngine
from hpsray.training.layout import index_batch
from hpsray.training.strategies import BspSteps

from gpus import DEVICES  # tests/gpus.py

N_SLOTS, N_DENSE = 6, 3


def _batches(n: int, rows: int, keys_per_example: int = 12, seed: int = 5) -> list[Batch]:
    gen = PlantedCTR(
        n_slots=N_SLOTS,
        keys_per_slot=800,
        n_dense=N_DENSE,
        seed=seed,
        nnz_per_slot=PlantedCTR.spread_nnz(N_SLOTS, keys_per_example),
    )
    return [gen.generate(rows) for _ in range(n)]


class Owner:
    """The owners' side, as plainly as possible: every row in a dict, lent whole each batch
    (keys the trainer held in the batch before are marked held and not shipped)."""

    def __init__(self, config: TrainConfig) -> None:
        self.config, self.rows = config, {}
        self.lent = np.empty(0, np.uint64)

    def lend(self, keys: np.ndarray) -> Loan:
        held = np.isin(keys, self.lent)
        new = keys[~held]
        rows = initial_rows(new, self.config.row_width, self.config.row_init())
        for i, k in enumerate(new.tolist()):
            if k in self.rows:
                rows[i] = self.rows[k]
        self.lent = keys
        return Loan(rows, held if held.any() else None)

    def write_back(self, keys: np.ndarray, rows: np.ndarray) -> None:
        for k, r in zip(keys.tolist(), rows, strict=True):
            self.rows[k] = r.copy()


def _train(engine: TrainerEngine, owner: Owner, batches: list[Batch]) -> list[float]:
    losses = []
    for batch in batches:
        keys = np.unique(batch.keys)
        engine.borrow(0, [keys], [owner.lend(keys)])
        np.testing.assert_array_equal(np.sort(engine.hbm.tables[0].keys()), keys)  # exactly the batch's rows
        losses.append(engine.close_batch(engine.train_local(engine.index(batch))))
        owner.write_back(keys, engine.rows(keys))
    return losses


@pytest.mark.parametrize(
    ("sparse", "dense"), [("adagrad", "adam"), ("adagrad_row", "adagrad"), ("adam", "sgd"), ("sgd", "adam")]
)
def test_engine_equals_the_reference_to_the_bit(sparse, dense):
    config = TrainConfig(dim=8, hidden=(16, 8), minibatch_size=64, sparse_optimizer=sparse, dense_optimizer=dense)
    batches = _batches(4, 300)
    reference = ReferenceTrainer(N_SLOTS, N_DENSE, config)
    expected_losses = [reference.train_batch(b) for b in batches]
    engine, owner = TrainerEngine(config, N_SLOTS, N_DENSE, capacity=4000), Owner(config)
    losses = _train(engine, owner, batches)
    keys, rows, state = reference.export()
    assert sorted(owner.rows) == keys.tolist()
    np.testing.assert_array_equal(np.stack([owner.rows[k] for k in keys.tolist()]), rows)
    model = engine.dense.models[0].state_dict()
    for name, value in state.items():
        assert torch.equal(model[name], value), name
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    assert engine.step == reference.step


def test_index_lays_out_each_minibatch_as_the_bag_layout_does():
    """Keys out of slot order within an example, empty bags, a short last mini-batch."""
    rng = np.random.default_rng(1)
    n, m = 37, 8
    counts = rng.integers(0, 7, n)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    nnz = int(offsets[-1])
    batch = Batch(
        labels=rng.random(n).astype(np.float32),
        dense=rng.random((n, 2)).astype(np.float32),
        keys=rng.integers(1, 40, nnz).astype(np.uint64),
        offsets=offsets,
        slots=rng.integers(0, 4, nnz).astype(np.int32),
        n_slots=4,
    )
    slot_of = {k: 100 + 3 * k for k in range(40)}  # any injective map of keys to slots

    def find(keys, on_device):
        return torch.tensor([slot_of[int(k)] for k in keys], dtype=torch.int64)

    index = index_batch(batch, m, find, capacity=300, device=torch.device("cpu"))
    assert len(index) == -(-n // m) and index.n_examples == n
    for k, (mb, part) in enumerate(zip(index.minibatches, batch.minibatches(m), strict=True)):
        layout = BagLayout.of(part)
        assert mb.n_examples == len(part), k
        expected_rows = np.array([slot_of[int(x)] for x in layout.unique_keys[layout.inverse]], dtype=np.int64)
        np.testing.assert_array_equal(mb.rows[mb.inverse].numpy(), expected_rows)  # every occurrence, bag order
        np.testing.assert_array_equal(mb.bag_offsets.numpy(), layout.bag_offsets)
        np.testing.assert_array_equal(np.sort(mb.keys.numpy().view(np.uint64)), layout.unique_keys)
        assert len(set(mb.rows.tolist())) == mb.rows.numel()  # distinct rows
        # row u's bags, in bag order: every occurrence of u once
        bag_of = np.repeat(np.arange(len(part) * 4), np.diff(np.append(layout.bag_offsets, layout.inverse.size)))
        for u in range(mb.rows.numel()):
            lo = int(mb.grad_offsets[u])
            hi = int(mb.grad_offsets[u + 1]) if u + 1 < mb.rows.numel() else mb.grad_bags.numel()
            mine = np.flatnonzero(mb.inverse.numpy() == u)
            np.testing.assert_array_equal(mb.grad_bags[lo:hi].numpy(), bag_of[mine])


def test_a_batch_key_without_a_row_is_a_clear_error():
    config = TrainConfig(dim=4, hidden=(8,), minibatch_size=32)
    engine = TrainerEngine(config, N_SLOTS, N_DENSE, capacity=2000)
    batch = _batches(1, 50)[0]
    keys = np.unique(batch.keys)
    engine.borrow(0, [keys[1:]], [Owner(config).lend(keys[1:])])  # the loan lacks one key
    with pytest.raises(MissingRowsError, match=f"first key: {keys[0]}"):
        engine.index(batch)


def _one_minibatch_engine(keys_per_example: int = 26):
    config = TrainConfig(dim=16, hidden=(32, 16), minibatch_size=256)
    batch = _batches(1, 256 * 3, keys_per_example)[0]
    engine = TrainerEngine(config, N_SLOTS, N_DENSE, capacity=20_000)
    keys = np.unique(batch.keys)
    engine.borrow(0, [keys], [Owner(config).lend(keys)])
    index = engine.index(batch)
    engine.train_local(index)  # warm: the first step allocates, later ones reuse
    return engine, index, batch.keys


def test_a_minibatch_step_stays_within_its_launch_budget():
    """The step alone (one node): launching ops within budget, no read-back, no numba call, no
    sort (``budget.py``; each guard shown failing in test_budgets.py)."""
    engine, index, _ = _one_minibatch_engine()
    tally(lambda: engine.train_local(index)).check(LAUNCHES["local"])


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_reads_nothing_back_from_the_device(device):
    """On CUDA the mini-batch steps run under torch's sync debug mode set to error: a
    read-back inside them fails the test. The result matches the reference."""
    config = TrainConfig(dim=8, hidden=(16, 8), minibatch_size=64)
    batches = _batches(2, 300)
    reference = ReferenceTrainer(N_SLOTS, N_DENSE, config)
    for b in batches:
        reference.train_batch(b)
    engine, owner = TrainerEngine(config, N_SLOTS, N_DENSE, capacity=4000, device=device), Owner(config)
    for batch in batches:
        keys = np.unique(batch.keys)
        engine.borrow(0, [keys], [owner.lend(keys)])
        index = engine.index(batch)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            losses = engine.train_local(index)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        engine.close_batch(losses)
        owner.write_back(keys, engine.rows(keys))
    keys, rows, _ = reference.export()
    atol = 1e-5 if device == "cuda" else 1e-6  # CUDA's atomic sums add in another order (seen: 3.4e-6 on an H200)
    np.testing.assert_allclose(np.stack([owner.rows[k] for k in keys.tolist()]), rows, rtol=1e-4, atol=atol)


def test_two_engines_under_bsp_apply_every_nodes_update_and_match_the_reference():
    """Two nodes as two engines in threads: each trains its share, both hold the same rows
    after every batch, and the result is the reference's over the global mini-batches."""
    config = TrainConfig(dim=8, hidden=(16, 8), minibatch_size=64, sparse_optimizer="sgd", dense_optimizer="sgd")
    shares = [_batches(3, 200, seed=5), _batches(3, 150, seed=6)]  # node 1 runs out of examples first
    m = config.minibatch_size
    reference = ReferenceTrainer(N_SLOTS, N_DENSE, config)
    for parts in zip(*shares, strict=True):
        steps = max(-(-len(p) // m) for p in parts)
        reference.train_minibatches(
            [Batch.concat([p.slice(k * m, (k + 1) * m) for p in parts if k * m < len(p)]) for k in range(steps)]
        )
    group = ThreadGroup(2)
    engines = [TrainerEngine(config, N_SLOTS, N_DENSE, capacity=4000, n_nodes=2) for _ in range(2)]
    members = [group.member(r) for r in range(2)]
    strategies = [BspSteps(e, m, m.allreduce_sum) for e, m in zip(engines, members, strict=True)]
    store: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def run(rank: int, t: int) -> None:
        try:
            batch, engine = shares[rank][t], engines[rank]
            keys = np.unique(batch.keys)
            rows = initial_rows(keys, config.row_width, config.row_init())
            for i, k in enumerate(keys.tolist()):
                if k in store:
                    rows[i] = store[k]
            engine.borrow(t, [keys], [Loan(rows)])
            sizes = [len(shares[0][t]), len(shares[1][t])]
            engine.close_batch(strategies[rank].steps(engine.index(batch), sizes))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            group.barrier.abort()

    for t in range(3):
        threads = [threading.Thread(target=run, args=(r, t)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        shared = np.intersect1d(shares[0][t].keys, shares[1][t].keys)
        assert shared.size > 0
        np.testing.assert_array_equal(engines[0].rows(shared), engines[1].rows(shared))  # one update everywhere
        for engine, batch in zip(engines, (shares[0][t], shares[1][t]), strict=True):
            keys = np.unique(batch.keys)
            for k, r in zip(keys.tolist(), engine.rows(keys), strict=True):
                store[k] = r.copy()
    keys, rows, state = reference.export()
    np.testing.assert_allclose(np.stack([store[k] for k in keys.tolist()]), rows, rtol=1e-5, atol=1e-7)
    for name, value in engines[0].dense.models[0].state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=1e-5, atol=1e-7)
    assert engines[0].step == engines[1].step == reference.step
