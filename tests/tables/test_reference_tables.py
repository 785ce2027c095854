"""The reference trainer with tables of their own (issue 43): one row store per table at its
width, its own optimizer and pooling; without tables, what it computed before."""

import numpy as np
import pytest
import torch

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.data.batch import Batch
from hpsray.data.keys import hash_keys
from hpsray.errors import ConfigError
from hpsray.kernels.init import initial_rows
from hpsray.reference import ReferenceTrainer
from hpsray.reference_tables import predict_input
from hpsray.tables import TableSpec

GEN = PlantedCTR(n_slots=4, keys_per_slot=60, nnz_per_slot=PlantedCTR.spread_nnz(4, 7), n_dense=3, seed=3)
THREE = (
    TableSpec("small", (0, 2), 4),
    TableSpec("lists", (1,), 16, "mean"),
    TableSpec("ids", (3,), 8, optimizer="adam", lr=0.002),
)


def config(tables=(), **kw):
    return TrainConfig(**{"dim": 4, "hidden": (8,), "minibatch_size": 32, "tables": tables, **kw})


def fit(cfg, rows=256, **kw):
    ref = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg, **kw)
    for batch in GEN.batches(rows, 128):
        ref.train_batch(batch)
    return ref


def test_three_tables_hold_rows_at_their_own_widths():
    ref = fit(config(THREE))
    got = ref.export_tables()
    assert list(got) == ["small", "lists", "ids"]
    assert [rows.shape[1] for _, rows in got.values()] == [8, 32, 24]  # ids: adam's 2 * dim moments
    tables = ref.tables
    for t, (keys, rows) in enumerate(got.values()):
        assert keys.size > 0 and (tables.table_of(keys) == t).all()
        assert np.isfinite(rows).all()
    ids_rows = got["ids"][1]
    assert (ids_rows[:, 8:] != 0).any()  # the moments moved: the ids table stepped with Adam
    assert (got["small"][1][:, 4:] > ref.tables.optimizers[0].state_init()).any()  # adagrad's sums grew
    assert 0.0 <= ref.evaluate(GEN.batches(128, 128, start_row=256)).auc <= 1.0
    with pytest.raises(ValueError, match="export_tables"):
        ref.export()


def test_mean_pooling_is_the_bags_sum_over_its_count():
    """Two examples, two slots: slot 0 (sum, dim 2), slot 1 (mean, dim 3); example 0 has three
    keys in slot 1, example 1 none (its bag pools to zeros)."""
    cfg = config((TableSpec("a", (0,), 2), TableSpec("b", (1,), 3, "mean")), dim=2)
    raw = np.concatenate([hash_keys(0, np.array([5])), hash_keys(1, np.array([5, 6, 7])), hash_keys(0, np.array([9]))])
    batch = Batch(
        labels=np.zeros(2, np.float32),
        dense=np.zeros((2, 1), np.float32),
        keys=raw,
        offsets=np.array([0, 4, 5], np.int64),
        slots=np.array([0, 1, 1, 1, 0], np.int32),
        n_slots=2,
    )
    ref = ReferenceTrainer(2, 1, cfg)
    x = predict_input(ref, batch).numpy()
    tables = ref.tables
    tagged = tables.tag(raw, batch.slots)
    rows = [
        initial_rows(tagged[i : i + 1], tables.widths[t], tables.row_inits[t])[0]
        for i, t in enumerate(tables.slot_table[batch.slots])
    ]
    assert x.shape == (2, 5)  # dims 2 and 3, concatenated in slot order
    assert np.array_equal(x[0, :2], rows[0][:2])
    assert np.array_equal(x[0, 2:], (rows[1][:3] + rows[2][:3] + rows[3][:3]) / np.float32(3))
    assert np.array_equal(x[1, :2], rows[4][:2])
    assert np.array_equal(x[1, 2:], np.zeros(3, np.float32))


def test_one_table_of_every_slot_equals_the_default_bit_for_bit():
    """An explicit table with the config's settings takes the tables' path: it must compute
    what the default (no tables) computes, row for row and weight for weight."""
    default = fit(config())
    one = fit(config((TableSpec("all", (0, 1, 2, 3), 4),)))
    keys, rows, dense = default.export()
    ((k1, r1),) = one.export_tables().values()
    assert np.array_equal(keys, k1) and np.array_equal(rows, r1)
    for name, w in one.dense_state().items():
        assert torch.equal(w, dense[name]), name


def test_shares_of_two_nodes_train_every_table():
    cfg = config(THREE)
    ref = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)
    batch = GEN.generate(64)
    loss = ref.train_shares([batch.slice(0, 32), [batch.slice(32, 48), batch.slice(48, 64)]])
    assert np.isfinite(loss) and ref.examples == 64 and ref.step == 1
    assert all(len(store) > 0 for store in ref.stores)


def test_a_tables_own_admission_holds_back_its_rows_only():
    strict = (THREE[0], THREE[1], TableSpec("ids", (3,), 8, optimizer="adam", lr=0.002, admit_after=1000))
    ref = fit(config(strict))
    assert len(ref.stores[2]) == 0 and len(ref.stores[0]) > 0 and len(ref.stores[1]) > 0
    assert ref.admissions[2] is not None and ref.admissions[2].stats["rejected"] > 0
    assert ref.admissions[0] is None


def test_dlrm_and_deepfm_need_one_dim_for_every_slot():
    for kind in ("dlrm", "deepfm"):
        with pytest.raises(ConfigError) as e:
            ReferenceTrainer(GEN.n_slots, GEN.n_dense, config(THREE, model_kind=kind))
        assert "small (dim 4, sum)" in str(e.value) and "lists (dim 16, mean)" in str(e.value)
    same = tuple(TableSpec(s.name, s.slots, 4, s.pooling, s.optimizer, s.lr) for s in THREE)
    ref = fit(config(same, model_kind="dlrm"), rows=128)
    assert [r.shape[1] for _, r in ref.export_tables().values()] == [8, 8, 12]
