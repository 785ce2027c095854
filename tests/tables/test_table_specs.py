"""Tables of their own (issue 43): a table's settings checked, naming the table and the field,
and the key contract (docs/architecture.md, "Keys and partitioning")."""

import pickle

import numpy as np
import pytest

from hpsray.config import TrainConfig
from hpsray.data.keys import hash_keys
from hpsray.errors import ConfigError
from hpsray.kernels.hashing import EMPTY_KEY
from hpsray.tables import MAX_TABLES, TableSpec, check_tables


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dim": 0}, "dim"),
        ({"pooling": "max"}, "pooling"),
        ({"optimizer": "rmsprop"}, "optimizer"),
        ({"lr": -0.1}, "lr"),
        ({"slots": (1, 1)}, "slots"),
        ({"slots": ()}, "slots"),
        ({"slots": (-1,)}, "slots"),
        ({"admit_after": -1}, "admit_after"),
        ({"expire_after_batches": 0}, "expire_after_batches"),
    ],
)
def test_a_bad_table_setting_names_the_table_and_the_field(kwargs, field):
    spec = {"name": "ids", "slots": (0,), "dim": 8, **kwargs}
    with pytest.raises(ConfigError) as e:
        TableSpec(**spec)
    assert e.value.key == field and "'ids'" in e.value.reason, str(e.value)


@pytest.mark.parametrize(
    "specs, key, words",
    [
        ([TableSpec("a", (0, 1), 4), TableSpec("b", (1, 2), 4)], "tables[1].slots", ["'b'", "slot 1", "'a'"]),
        ([TableSpec("a", (0, 1), 4), TableSpec("b", (2, 3), 4)], "tables[1].slots", ["'b'", "slot 3", "range"]),
        ([TableSpec("a", (0,), 4), TableSpec("b", (1,), 4)], "tables", ["[2]", "in none"]),
        ([TableSpec("a", (0,), 4), TableSpec("a", (1, 2), 4)], "tables[1].name", ["'a'"]),
        (
            [TableSpec("a", (0, 1), 4), TableSpec("b", (2,), 4, optimizer="adam", sparse_params={"rho": 1.0})],
            "tables[1].sparse_params",
            ["'b'", "rho"],
        ),
    ],
)
def test_the_set_puts_every_slot_in_exactly_one_named_table(specs, key, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig(tables=tuple(specs)).tables_for(3)
    assert e.value.key == key, str(e.value)
    assert all(w in e.value.reason for w in words), str(e.value)


def three_tables(**kw):
    return TrainConfig(
        dim=4,
        tables=(
            TableSpec("small", (0, 2), 4),
            TableSpec("lists", (1,), 16, "mean"),
            TableSpec("ids", (3,), 8, optimizer="adam", lr=0.002),
        ),
        **kw,
    )


def test_each_table_has_its_width_optimizer_and_row_bytes():
    t = three_tables().tables_for(4)
    assert t.dims == (4, 16, 8) and t.slot_dims == (4, 16, 4, 8)
    assert t.widths == (8, 32, 24)  # adagrad: dim accumulators; adam: 2 * dim moments
    assert t.row_bytes == (32, 128, 96)
    assert [type(o).__name__ for o in t.optimizers] == ["Adagrad", "Adagrad", "Adam"]
    assert t.optimizers[2].lr == 0.002 and t.optimizers[0].lr == 0.05  # the config's where not its own
    assert list(t.slot_table) == [0, 1, 0, 2]


def test_keys_of_two_tables_never_collide_and_carry_their_table():
    tables = three_tables().tables_for(4)
    values = np.arange(1000, dtype=np.uint64)
    raw = hash_keys(0, values)  # the same raw keys placed in every table's slots
    tagged = [tables.tag(raw, np.full(raw.size, s)) for s in (0, 1, 3)]
    assert len(np.unique(np.concatenate(tagged))) == 3 * raw.size
    for t, keys in enumerate(tagged):
        assert (tables.table_of(keys) == t).all()
        assert ((keys & np.uint64((1 << 56) - 1)) == (raw & np.uint64((1 << 56) - 1))).all()


def test_one_table_leaves_keys_as_they_are():
    raw = hash_keys(np.array([0, 1, 2]), np.array([7, 7, 7], dtype=np.uint64))
    for config in (TrainConfig(dim=4), TrainConfig(dim=4, tables=(TableSpec("all", (0, 1, 2), 4),))):
        tables = config.tables_for(3)
        assert not tables.tagged
        assert np.array_equal(tables.tag(raw, np.array([0, 1, 2])), raw)
        assert (tables.table_of(raw) == 0).all()
    default = TrainConfig(dim=4).tables_for(3)
    assert default.names() == ("default",) and default.widths == (TrainConfig(dim=4).row_width,)


def test_a_tagged_key_is_never_the_empty_marker():
    n = MAX_TABLES
    tables = TrainConfig(dim=2, tables=tuple(TableSpec(f"t{i}", (i,), 2) for i in range(n))).tables_for(n)
    keys = np.full(n, EMPTY_KEY - np.uint64(1), dtype=np.uint64)  # the largest key the mix gives
    tagged = tables.tag(keys, np.arange(n))
    assert not (tagged == EMPTY_KEY).any()
    assert list(tables.table_of(tagged)) == list(range(n))
    with pytest.raises(ConfigError, match="at most 255"):
        TrainConfig(dim=2, tables=tuple(TableSpec(f"t{i}", (i,), 2) for i in range(n + 1))).tables_for(n + 1)


def test_a_config_with_tables_pickles_and_compares():
    config = three_tables()
    assert pickle.loads(pickle.dumps(config)) == config
    assert config != TrainConfig(dim=4)
    # rows of the working set and the loans: the widest table's (the lists' 16 weights and 16 sums)
    assert config.row_width == 32 and config.row_dim == 16
    assert TrainConfig(dim=4).row_width == 8 and TrainConfig(dim=4).row_dim == 4


def test_one_table_of_its_own_layout_gives_the_rows_its_width_and_initialiser():
    own = TrainConfig(dim=4, tables=(TableSpec("all", (0, 1), 8, optimizer="adam"),))
    assert (own.row_width, own.row_dim) == (24, 8)  # 8 weights, Adam's 16
    table = own.tables_for(2)
    assert own.row_init() == table.row_inits[0]


def test_the_pipeline_runs_tables_of_any_width_and_optimizer():
    for tables in (
        (TableSpec("all", (0, 1), 4),),
        (TableSpec("all", (0, 1), 4, "mean"),),
        (TableSpec("a", (0,), 4), TableSpec("b", (1,), 4, lr=0.5)),
        (TableSpec("all", (0, 1), 8),),
        (TableSpec("all", (0, 1), 4, optimizer="adam"),),
        (TableSpec("a", (0,), 4), TableSpec("b", (1,), 4, sparse_params={"eps": 0.1})),
    ):
        check_tables(TrainConfig(dim=4, tables=tables), 2)
    # tables of several layouts in every mode: tests/cluster/test_tables_cluster.py
    check_tables(TrainConfig(dim=4, tables=(TableSpec("a", (0,), 4), TableSpec("b", (1,), 8, optimizer="adam"))), 2)
    with pytest.raises(ConfigError, match="slot 2 is out of range"):  # the tables' own checks
        check_tables(TrainConfig(dim=4, tables=(TableSpec("a", (0, 1, 2), 4),)), 2)
