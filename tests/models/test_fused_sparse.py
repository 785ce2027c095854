"""The fused sparse path (hpsray.kernels.fused) against the unfused one and the reference.

Lookup + pooling in one pass must give exactly ``F.embedding_bag``'s sums, the pooled gradient
summed per distinct row exactly the unfused backward's, and a trainer-style step through HbmPS
must end bit for bit where the reference trainer ends, for every sparse optimizer.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hpsray.config import TrainConfig
from hpsray.data import Batch, PlantedCTR
from hpsray.kernels import CpuHashTable, RowInit
from hpsray.kernels.fused import FusedOffer, bag_ends, lookup_probe, pool_backward
from hpsray.kernels.init import initial_rows
from hpsray.models.dnn import DNN
from hpsray.models.pooling import BagLayout, _bag_grad
from hpsray.models.step import DenseReplicas
from hpsray.reference import ReferenceTrainer
from hpsray.tiers.hbm import HbmPS


def random_batch(rng: np.random.Generator, examples: int, n_slots: int, vocab: int, shuffle: bool) -> Batch:
    """Examples with 0 to 4 keys per slot (empty bags and repeated keys included); with
    ``shuffle`` an example's keys are not in slot order."""
    per = rng.integers(0, 5, size=(examples, n_slots))
    slots, keys, offsets = [], [], [0]
    for e in range(examples):
        s = np.repeat(np.arange(n_slots, dtype=np.int32), per[e])
        if shuffle:
            s = rng.permutation(s)
        slots.append(s)
        keys.append(rng.integers(1, vocab, size=s.size).astype(np.uint64) * np.uint64(97) + s.astype(np.uint64))
        offsets.append(offsets[-1] + s.size)
    return Batch(
        labels=(rng.random(examples) < 0.3).astype(np.float32),
        dense=rng.standard_normal((examples, 2)).astype(np.float32),
        keys=np.concatenate(keys) if keys else np.empty(0, np.uint64),
        offsets=np.array(offsets, dtype=np.int64),
        slots=np.concatenate(slots) if slots else np.empty(0, np.int32),
        n_slots=n_slots,
    )


def table_of(keys: np.ndarray, width: int, rng: np.random.Generator, extra: int = 50) -> CpuHashTable:
    """A table holding ``keys`` (and some others) with rows of mixed magnitudes."""
    table = CpuHashTable(keys.size + extra + 16, width, RowInit(dim=width, scale=0.1))
    others = rng.integers(2**40, 2**41, size=extra).astype(np.uint64)
    every = np.concatenate([others[: extra // 2], keys, others[extra // 2 :]])
    every = every[np.sort(np.unique(every, return_index=True)[1])]
    rows = rng.standard_normal((every.size, width)).astype(np.float32)
    rows *= np.float32(10.0) ** rng.integers(-3, 4, size=(every.size, 1)).astype(np.float32)
    table.insert_or_assign(every, rows)
    return table


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 30), st.integers(1, 6), st.booleans())
def test_fused_lookup_pooling_and_backward_equal_the_unfused_path(seed, examples, n_slots, shuffle):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, examples, n_slots, vocab=12, shuffle=shuffle)
    dim = 5
    layout = BagLayout.of(batch)
    table = table_of(layout.unique_keys, dim + 3, rng)

    ends, order = bag_ends(batch.offsets, batch.slots, batch.n_slots)
    np.testing.assert_array_equal(ends[:-1], layout.bag_offsets)
    in_bag_order = batch.keys if order is None else batch.keys[order]
    np.testing.assert_array_equal(in_bag_order, layout.unique_keys[layout.inverse])
    pooled, slots = table.lookup_pool(layout.unique_keys, layout.inverse, ends, dim)
    np.testing.assert_array_equal(slots, table.find(layout.unique_keys))

    rows = torch.from_numpy(table.get(layout.unique_keys, columns=dim))
    expected = F.embedding_bag(
        torch.from_numpy(layout.inverse), rows, torch.from_numpy(layout.bag_offsets), mode="sum"
    ).numpy()
    np.testing.assert_array_equal(pooled, expected)  # bit for bit, empty bags zero

    grad_pooled = rng.standard_normal(pooled.shape).astype(np.float32)
    grads = pool_backward(grad_pooled, ends, layout.inverse, slots.size)
    unfused = np.zeros((layout.unique_keys.size, dim), np.float32)
    if layout.inverse.size:
        _bag_grad(layout.inverse, layout.bag_offsets, grad_pooled, unfused)
    np.testing.assert_array_equal(grads, unfused)


def test_a_missing_key_is_refused_like_get():
    rng = np.random.default_rng(1)
    batch = random_batch(rng, 6, 3, vocab=10, shuffle=False)
    layout = BagLayout.of(batch)
    table = table_of(layout.unique_keys[1:], 4, rng)
    ends, _ = bag_ends(batch.offsets, batch.slots, batch.n_slots)
    with pytest.raises(KeyError, match="not in the table"):
        table.lookup_pool(layout.unique_keys, layout.inverse, ends, 4)


GEN = PlantedCTR(n_slots=5, keys_per_slot=300, n_dense=3, seed=0, nnz_per_slot=PlantedCTR.spread_nnz(5, 12))


def trainer_like(cfg: TrainConfig, batch: Batch, n_devices: int = 1, replicas: int = 1, hide_offer: bool = False):
    keys = np.unique(batch.keys)
    hbm = HbmPS(keys.size + 10, cfg.row_width, cfg.row_init(), n_devices=n_devices)
    hbm.insert(keys, initial_rows(keys, cfg.row_width, cfg.row_init()))
    dense = DenseReplicas(
        DNN(GEN.n_slots, cfg.dim, GEN.n_dense, cfg.hidden, seed=cfg.seed), replicas, cfg.dense_optimizer, cfg.dense_lr
    )
    optimizer = cfg.optimizer()
    fused_steps = 0

    def weights_of(k):
        got = hbm.get(k, columns=cfg.dim)
        return np.asarray(got) if hide_offer else got  # np.asarray drops the offer: the unfused path

    for step, mb in enumerate(batch.minibatches(cfg.minibatch_size), 1):
        _, gkeys, grads = dense.step(mb, weights_of)
        fused_steps += hbm._fused is not None
        hbm.apply_gradients(gkeys, grads, optimizer, step)
    return hbm.get(keys), dense.models[0].state_dict(), fused_steps


@pytest.mark.parametrize("optimizer", ["adagrad", "adagrad_row", "adam", "sgd"])
def test_a_fused_trainer_step_ends_bit_for_bit_where_the_reference_ends(optimizer):
    cfg = TrainConfig(dim=8, hidden=(16,), minibatch_size=256, sparse_optimizer=optimizer, sparse_lr=0.05)
    batch = GEN.generate(1500)
    ref = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)
    ref.train_batch(batch)
    ref_keys, ref_rows, ref_dense = ref.export()
    rows, dense, fused = trainer_like(cfg, batch)
    assert fused == 6  # every mini-batch took the fused path
    np.testing.assert_array_equal(rows, ref_rows)
    for name, value in ref_dense.items():
        assert torch.equal(dense[name], value), name


def test_the_unfused_paths_stay_and_agree():
    """Two tables (no fused path), a caller that reshapes the rows (offer dropped) and two
    replicas (fused per replica, gradients concatenated, applied by lookup) all end equal."""
    cfg = TrainConfig(dim=8, hidden=(16,), minibatch_size=256, sparse_lr=0.05)
    batch = GEN.generate(1000)
    fused_rows, fused_dense, n = trainer_like(cfg, batch)
    assert n == 4
    for kwargs in ({"n_devices": 2}, {"hide_offer": True}):
        rows, dense, n = trainer_like(cfg, batch, **kwargs)
        assert n == 0
        np.testing.assert_array_equal(rows, fused_rows)
        assert all(torch.equal(dense[k], v) for k, v in fused_dense.items())
    two, _, _ = trainer_like(cfg, batch, replicas=2)
    two_unfused, _, _ = trainer_like(cfg, batch, replicas=2, hide_offer=True)
    np.testing.assert_array_equal(two, two_unfused)


def test_the_probe_and_a_table_changed_before_the_update():
    cfg = TrainConfig(dim=4, hidden=(8,), minibatch_size=64)
    hbm = HbmPS(2000, cfg.row_width, cfg.row_init())
    offer = hbm.get(lookup_probe(), columns=4)
    assert isinstance(offer, FusedOffer) and offer.shape == (0, 4) and offer.lookup is not None
    assert getattr(offer[:, :2], "lookup", None) is None  # derived arrays carry no path
    assert not isinstance(HbmPS(100, cfg.row_width, cfg.row_init(), n_devices=2).get(lookup_probe()), FusedOffer)

    batch = GEN.generate(64)
    keys = np.unique(batch.keys)
    hbm.insert(keys, initial_rows(keys, cfg.row_width, cfg.row_init()))
    dense = DenseReplicas(DNN(GEN.n_slots, 4, GEN.n_dense, (8,), seed=0), 1, cfg.dense_optimizer, cfg.dense_lr)
    _, gkeys, grads = dense.step(batch, lambda k: hbm.get(k, columns=4))
    before = hbm.get(gkeys)
    moved = gkeys[:3]
    rows = hbm.get(moved)
    hbm.tables[0].erase(moved)  # the slots are reused by other keys, then the keys come back elsewhere
    hbm.tables[0].insert_or_assign(np.array([2**50, 2**50 + 1, 2**50 + 2], np.uint64), np.zeros((3, 8), np.float32))
    hbm.tables[0].insert_or_assign(moved, rows)
    opt = cfg.optimizer()
    hbm.apply_gradients(gkeys, grads, opt, 1)  # looked up again: lands on the keys' new slots
    expected = before.copy()
    from hpsray.kernels.optim import apply_to_rows

    apply_to_rows(expected, grads, opt, 1)
    np.testing.assert_array_equal(hbm.get(gkeys), expected)
