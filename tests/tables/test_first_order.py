"""First-order rows (issue 42): DeepFM's and Wide & Deep's ``w_i`` in a width-1 table of their
own, each key looked up in its embedding table and in the first-order table."""

import numpy as np
import pytest

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.data.batch import Batch
from hpsray.data.keys import hash_keys
from hpsray.errors import ConfigError
from hpsray.first_order import FIRST_ORDER, expand
from hpsray.reference import ReferenceTrainer
from hpsray.serving.tables import SlotTables
from hpsray.tables import TAG_SHIFT, Tables, TableSpec, TagKeys, with_first_order

GEN = PlantedCTR(n_slots=3, keys_per_slot=40, nnz_per_slot=PlantedCTR.spread_nnz(3, 5), n_dense=2, seed=4)


def _batch() -> Batch:
    """Two examples over 3 slots: example 0 has keys in slots 0, 1, 1, 2; example 1 in 2, 0."""
    keys = np.array([10, 11, 12, 13, 20, 21], dtype=np.uint64)
    return Batch(
        labels=np.zeros(2, np.float32),
        dense=np.zeros((2, 1), np.float32),
        keys=keys,
        offsets=np.array([0, 4, 6], np.int64),
        slots=np.array([0, 1, 1, 2, 2, 0], np.int32),
        n_slots=3,
    )


def test_expand_appends_each_examples_copied_keys_after_its_own():
    got = expand(_batch(), np.array([0, 1, 2]))
    assert got.n_slots == 6
    assert got.offsets.tolist() == [0, 8, 12]
    assert got.keys.tolist() == [10, 11, 12, 13, 10, 11, 12, 13, 20, 21, 20, 21]
    assert got.slots.tolist() == [0, 1, 1, 2, 3, 4, 4, 5, 2, 0, 5, 3]
    # a table copying slots 2 and 0 only, and a slot copied twice (two copy tables)
    some = expand(_batch(), np.array([2, 0, 2]))
    assert some.n_slots == 6 and some.offsets.tolist() == [0, 7, 12]
    assert some.keys.tolist() == [10, 11, 12, 13, 10, 13, 13, 20, 21, 20, 20, 21]
    assert some.slots.tolist() == [0, 1, 1, 2, 4, 3, 5, 2, 0, 3, 5, 4]
    plain = _batch()
    assert expand(plain, np.empty(0, np.int64)) is plain


def test_with_first_order_adds_the_first_order_table_to_the_kinds_that_need_it_once():
    plain = TrainConfig(dim=4, model_kind="deepfm")
    bound = with_first_order(plain, 3)
    assert [(s.name, s.slots, s.dim, s.copy) for s in bound.tables] == [
        ("default", (0, 1, 2), 4, False),
        (FIRST_ORDER, (0, 1, 2), 1, True),
    ]
    assert with_first_order(bound, 3) is bound  # idempotent
    assert with_first_order(TrainConfig(dim=4), 3).tables == ()  # mlp: no first-order rows
    own = TrainConfig(dim=4, model_kind="wide_deep", tables=(TableSpec("a", (0, 2), 4), TableSpec("b", (1,), 4)))
    assert [s.name for s in with_first_order(own, 3).tables] == ["a", "b", FIRST_ORDER]
    mine = TrainConfig(dim=4, model_kind="deepfm", tables=(TableSpec(FIRST_ORDER, (0, 1, 2), 4),))
    with pytest.raises(ConfigError, match="'first_order' names the first-order table of kind 'deepfm'"):
        with_first_order(mine, 3)


def test_the_copies_keys_carry_the_first_order_tables_tag():
    tables = Tables.of(TrainConfig(dim=4, model_kind="deepfm"), 3)
    assert (tables.n_data_slots, tables.n_slots) == (3, 6)
    assert tables.copy_of.tolist() == [0, 1, 2] and tables.slot_table.tolist() == [0, 0, 0, 1, 1, 1]
    assert tables.dims == (4, 1) and tables.widths == (8, 2)  # adagrad: the weight and its own sum
    got = TagKeys(tables)(_batch())
    tag = (got.keys >> TAG_SHIFT).astype(int)
    assert tag.tolist() == [0] * 4 + [1] * 4 + [0] * 2 + [1] * 2
    low = got.keys & np.uint64((1 << 56) - 1)
    assert low[:4].tolist() == low[4:8].tolist()  # the same (slot, value) mix, another table
    # serving reads the export's tables back and expands and tags a request the same way
    served = SlotTables.from_manifest(tables.manifest(), 3, "manifest.json")
    assert served is not None and served.n_slots == 6 and served.slot_dims == (4, 4, 4, 1, 1, 1)
    request = served.tag(_batch())
    assert np.array_equal(request.keys, got.keys) and np.array_equal(request.slots, got.slots)


def test_a_manifest_whose_copy_table_names_an_unknown_slot_is_refused():
    entries = [
        {"name": "default", "slots": [0, 1, 2], "dim": 4, "pooling": "sum"},
        {"name": FIRST_ORDER, "slots": [0, 3], "dim": 1, "pooling": "sum", "copy": True},
    ]
    with pytest.raises(ValueError, match="manifest.json: tables: table 'first_order': slots"):
        SlotTables.from_manifest(entries, 3, "manifest.json")


@pytest.mark.parametrize("optimizer", ["adagrad_row", "adam"])
def test_the_reference_holds_each_keys_first_order_weight_in_a_row_of_its_own(optimizer):
    cfg = TrainConfig(dim=4, hidden=(8,), minibatch_size=32, model_kind="deepfm", sparse_optimizer=optimizer)
    ref = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)
    for batch in GEN.batches(256, 128):
        ref.train_batch(batch)
    got = ref.export_tables()
    assert list(got) == ["default", FIRST_ORDER]
    (ek, erows), (fk, frows) = got["default"], got[FIRST_ORDER]
    assert erows.shape[1] == {"adagrad_row": 5, "adam": 12}[optimizer]  # v_i: 4 factors, all of them
    assert frows.shape[1] == {"adagrad_row": 2, "adam": 3}[optimizer]  # w_i and its own optimizer state
    assert np.array_equal(np.sort(fk & np.uint64((1 << 56) - 1)), np.sort(ek & np.uint64((1 << 56) - 1)))
    assert (frows[:, 0] != 0).any()  # the first-order weights learned
    if optimizer == "adagrad_row":  # each w_i's accumulator is its own: not its embedding row's
        order_e, order_f = np.argsort(ek & np.uint64((1 << 56) - 1)), np.argsort(fk & np.uint64((1 << 56) - 1))
        assert not np.allclose(frows[order_f, 1], erows[order_e, 4])
    assert 0.0 <= ref.evaluate(GEN.batches(128, 128, start_row=256)).auc <= 1.0


def test_a_deepfm_key_is_looked_up_in_both_tables_by_the_raw_hash():
    tables = Tables.of(TrainConfig(dim=2, model_kind="wide_deep"), 2)
    raw = np.concatenate([hash_keys(0, np.array([5])), hash_keys(1, np.array([7]))])
    batch = Batch(
        labels=np.zeros(1, np.float32),
        dense=np.zeros((1, 0), np.float32),
        keys=raw,
        offsets=np.array([0, 2], np.int64),
        slots=np.array([0, 1], np.int32),
        n_slots=2,
    )
    got = TagKeys(tables)(batch)
    assert got.slots.tolist() == [0, 1, 2, 3]
    low = np.uint64((1 << 56) - 1)
    assert (got.keys & low).tolist() == (np.r_[raw, raw] & low).tolist()  # one (slot, value) mix per key
    assert (got.keys >> TAG_SHIFT).tolist() == [0, 0, 1, 1]  # looked up in the embeddings, then in w
