"""SSD-PS of several widths (issue 43): each row group's parameter files hold its rows at its own
width, and the store loads, compacts, deletes, snapshots and reopens them as SSDPS does one."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hpsray.config import TrainConfig
from hpsray.kernels.init import initial_rows
from hpsray.tables import TableSpec, tag_keys
from hpsray.tiers.grouped_mem import GroupedMemPS
from hpsray.tiers.rowgroups import GroupedRows, RowGroups
from hpsray.tiers.ssd.grouped import GroupedSSDPS, group_directory
from hpsray.tiers.ssd.paramfile import HEADER_BYTES, block_rows_for, file_bytes, n_blocks, read_index, record_bytes

# the issue's mix: a dim-4 sum table, a dim-16 mean table, a dim-8 table with its own Adam
THREE = (
    TableSpec("small", (0, 2), 4),
    TableSpec("lists", (1,), 16, "mean"),
    TableSpec("ids", (3,), 8, optimizer="adam", lr=0.01),
)
CONFIG = TrainConfig(dim=4, sparse_optimizer="adagrad", tables=THREE)


@pytest.fixture(scope="module")
def groups() -> RowGroups:
    return RowGroups.of(CONFIG.tables_for(4))


def keys_of(n: int, seed: int) -> np.ndarray:
    """``n`` distinct tagged keys spread over the four slots (three tables)."""
    rng = np.random.default_rng(seed)
    raw = rng.choice(1 << 40, n, replace=False).astype(np.uint64)
    slots = rng.integers(0, 4, n)
    return tag_keys(raw, slots, CONFIG.tables_for(4).slot_table)


def rows_of(groups: RowGroups, keys: np.ndarray, version: float) -> GroupedRows:
    at = groups.split(keys)
    rows = []
    for g, a in enumerate(at):
        r = np.empty((a.size, groups.widths[g]), np.float32)
        r[:] = (keys[a] % 1000).astype(np.float32)[:, None] + np.arange(groups.widths[g], dtype=np.float32) / 64
        rows.append(r + version)
    return GroupedRows(at, rows)


def assert_rows(got: GroupedRows, want: GroupedRows) -> None:
    assert len(got.rows) == len(want.rows)
    for g, (ga, gr, wa, wr) in enumerate(zip(got.at, got.rows, want.at, want.rows, strict=True)):
        np.testing.assert_array_equal(ga, wa, err_msg=f"group {g} positions")
        np.testing.assert_array_equal(gr, wr, err_msg=f"group {g} rows")


def test_the_issues_tables_make_three_groups_of_their_own_widths(groups):
    # adagrad keeps one float of state per weight, adam two: 4+4, 16+16, 8+16
    assert groups.widths == (8, 32, 24)
    assert groups.dims == (4, 16, 8)
    assert groups.table_group == (0, 1, 2)
    same = RowGroups.of(
        TrainConfig(dim=4, tables=(TableSpec("a", (0,), 4), TableSpec("b", (1,), 4, "mean"))).tables_for(2)
    )
    assert same.widths == (8,) and same.tables == ((0, 1),)  # one layout: one group, pooling aside


def test_parameter_files_hold_each_tables_rows_at_its_width(groups, tmp_path):
    keys = keys_of(3000, 1)
    with GroupedSSDPS(tmp_path / "ssd", groups, rows_per_file=256, background=False) as store:
        want = rows_of(groups, keys, 0.5)
        store.dump(keys, want)
        got, found = store.load(keys)
        assert found.all()
        assert_rows(got, want)
        by_tag = store.live_bytes_by_tag()
        stats = store.stats
    for g, width in enumerate(groups.widths):
        directory = group_directory(tmp_path / "ssd", g, width)
        names = [n for n in os.listdir(directory) if n.endswith(".hps")]
        assert names
        rows = 0
        for name in names:
            index = read_index(os.path.join(directory, name))
            assert index.header.width == width  # the file's rows are the group's, not the widest table's
            n = index.keys.size
            rows += n
            overhead = HEADER_BYTES + 4 * n_blocks(n, block_rows_for(width))  # the file's stated overhead
            size = os.path.getsize(os.path.join(directory, name))
            assert size == file_bytes(n, width) == overhead + n * record_bytes(width)
            assert record_bytes(width) == 16 + 4 * width  # key, version, the row's floats
        assert rows == want.at[g].size
        assert by_tag[g] == rows * record_bytes(width)  # each table is tagged with its index
    assert stats["live_rows"] == keys.size and len(stats["groups"]) == 3


def test_overwrites_deletes_compaction_a_relayout_and_a_reopen_keep_every_groups_rows(groups, tmp_path):
    keys = keys_of(2000, 2)
    with GroupedSSDPS(tmp_path / "ssd", groups, rows_per_file=128, background=False) as store:
        store.dump(keys, rows_of(groups, keys, 0.0))
        newer = keys[::3]
        store.dump(newer, rows_of(groups, newer, 7.0))
        gone = keys[1::7]
        assert store.delete(gone) == gone.size
        assert store.compact(full=True) > 0
        store.load(keys[::5])  # some load heat
        assert store.relayout() > 0  # every file rewritten, the tombstones left alone
    with GroupedSSDPS(tmp_path / "ssd", groups, rows_per_file=128, background=False) as store:
        got, found = store.load(keys)
        assert store.verify() > 0
    expect_found = ~np.isin(keys, gone)
    np.testing.assert_array_equal(found, expect_found)
    old, new = rows_of(groups, keys, 0.0), rows_of(groups, keys, 7.0)
    is_new = np.isin(keys, newer)
    for g, at in enumerate(got.at):
        want = np.where(is_new[at, None], new.rows[g], old.rows[g])
        want[~expect_found[at]] = 0.0
        np.testing.assert_array_equal(got.rows[g], want, err_msg=groups.describe(g))


def test_a_snapshot_restores_every_group(groups, tmp_path):
    keys = keys_of(1500, 3)
    with GroupedSSDPS(tmp_path / "ssd", groups, rows_per_file=200, background=False) as store:
        store.dump(keys, rows_of(groups, keys, 1.0))
        taken = store.snapshot(tmp_path / "snap")
        store.dump(keys, rows_of(groups, keys, 2.0))  # after the snapshot: not in it
    assert taken["rows"] == keys.size
    GroupedSSDPS.restore(tmp_path / "snap", tmp_path / "back", groups)
    with GroupedSSDPS(tmp_path / "back", groups, background=False) as store:
        got, found = store.load(keys)
    assert found.all()
    assert_rows(got, rows_of(groups, keys, 1.0))


def test_rows_of_another_groups_width_are_refused_naming_the_tables(groups, tmp_path):
    keys = keys_of(100, 4)
    rows = rows_of(groups, keys, 0.0)
    padded = GroupedRows(rows.at, [np.zeros((a.size, 32), np.float32) for a in rows.at])  # the widest table's
    with GroupedSSDPS(tmp_path / "ssd", groups, background=False) as store:
        with pytest.raises(ValueError, match=r"group 0 \(tables 'small', 8 floats a row\).*\(\d+, 8\)"):
            store.dump(keys, padded)
        assert len(store) == 0  # nothing of it was written


def test_a_key_of_no_table_is_refused(groups):
    with pytest.raises(ValueError, match="names no table"):
        groups.group_of(np.array([np.uint64(7) << np.uint64(56)], dtype=np.uint64))


def test_mem_ps_of_three_widths_spills_and_recalls_every_row_unchanged(groups, tmp_path):
    """Batches pulled through a small MEM-PS per group over the grouped SSD-PS (the load stage's
    part played here: misses read from the store or initialised), each row updated per batch;
    after a flush the store holds what a dict of rows computed, each row at its group's width."""
    tables = CONFIG.tables_for(4)
    inits = [tables.row_inits[ts[0]] for ts in groups.tables]
    keys = np.sort(keys_of(600, 5))
    rng = np.random.default_rng(6)
    want: dict[int, np.ndarray] = {}
    with GroupedSSDPS(tmp_path / "ssd", groups, rows_per_file=64, background=False) as ssd:
        mem = GroupedMemPS(groups, [120, 90, 60], ssd.stores, inits)
        for b in range(12):
            batch = np.sort(rng.choice(keys, 150, replace=False))
            rows, missing = mem.pull(b, batch)
            if missing.size:
                stored, found = ssd.load(batch[missing])
                for g, at in enumerate(groups.split(batch[missing])):
                    fresh = initial_rows(batch[missing][at], groups.widths[g], inits[g])
                    put = np.where(found[at, None], stored.rows[g], fresh)
                    place = np.searchsorted(rows.at[g], missing[at])
                    rows.rows[g][place] = put
            for g, at in enumerate(rows.at):
                rows.rows[g] += np.float32(b + 1)
                for k, r in zip(batch[at].tolist(), rows.rows[g], strict=True):
                    start = want.get(k)
                    if start is None:
                        start = initial_rows(np.array([k], np.uint64), groups.widths[g], inits[g])[0]
                    want[k] = start + np.float32(b + 1)
                    np.testing.assert_array_equal(r, want[k])  # what the cache and the store gave, updated
            mem.write_back(b, batch, rows)
            mem.unpin(b)
        stats = mem.stats
        assert stats["evicted_dirty"] > 0 and ssd.stats["live_rows"] > 0  # rows did spill to SSD-PS
        mem.flush()
        seen = np.array(sorted(want), np.uint64)
        got, found = ssd.load(seen)
    assert found.all()
    for g, at in enumerate(got.at):
        assert got.rows[g].shape[1] == groups.widths[g]
        np.testing.assert_array_equal(got.rows[g], np.stack([want[int(k)] for k in seen[at]]))


def test_mem_ps_budget_goes_first_to_each_groups_pinned_rows_then_by_share(groups):
    from hpsray.tiers.padded import group_capacities

    need, share = np.array([300.0, 100.0, 100.0]), np.array([1.0, 1.0, 2.0])
    rows = group_capacities(groups, need, share, 1000, None, None)
    assert rows == [375 + 93, 125 + 93, 125 + 187]  # a quarter over each need, then 375 rows by share
    tight = group_capacities(groups, need, share, 520, None, None)
    assert tight == [300 + 5, 100 + 5, 100 + 10]  # no room for the margin: the needs exactly
    starved = group_capacities(groups, need, share, 400, None, None)
    assert starved == [100, 100, 200]  # less than the needs: by share (a pull then names the group's limit)
    by_bytes = group_capacities(groups, np.zeros(3), np.ones(3), None, 1 << 20, None)
    # equal shares of the keys: equal rows, each at its width (8, 32, 24 floats), within the budget
    assert max(by_bytes) - min(by_bytes) <= 0.2 * max(by_bytes)  # (hash buckets weigh more on narrow rows)
    assert sum(r * (4 * w + 54) for r, w in zip(by_bytes, groups.widths)) <= 1 << 20


def test_an_export_of_the_tables_loads_each_groups_rows_at_its_width(groups, tmp_path):
    """``init_from`` of tables of several layouts: the export's rows (weights and state columns
    as wide as the widest table's parts) go to their groups' stores, each row its own weights
    and state; a store of another node takes only its keys."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hpsray.export.layout import ExportLayout
    from hpsray.tiers.partition import owner_of
    from hpsray.tiers.ssd.bulkload import TableImport

    layout = ExportLayout.of(CONFIG)
    assert layout is not None and (layout.dim, layout.state_width) == (16, 16)
    keys = keys_of(2000, 5)
    trained = np.zeros((keys.size, max(groups.widths)), np.float32)
    want = rows_of(groups, keys, 0.25)
    for a, r in zip(want.at, want.rows, strict=True):
        trained[a, : r.shape[1]] = r
    stored = layout.to_export(keys, trained)
    export = tmp_path / "export"
    export.mkdir()

    def column(values: np.ndarray) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])

    table = pa.table({"key": pa.array(keys), "weights": column(stored[:, :16]), "state": column(stored[:, 16:])})
    pq.write_table(table, export / "rows-0.parquet")
    spec = TableImport(str(export), CONFIG.row_dim)
    with GroupedSSDPS(tmp_path / "ssd", groups, rows_per_file=256, background=False) as store:
        assert store.bulk_load(spec)["rows"] == keys.size
        got, found = store.load(keys)
    assert found.all()
    assert_rows(got, want)
    with GroupedSSDPS(tmp_path / "node1", groups, rows_per_file=256, background=False) as store:
        store.bulk_load(spec, shard=(1, 2))
        mine = owner_of(keys, 2) == 1
        assert len(store) == int(mine.sum())
        assert store.contains(keys).tolist() == mine.tolist()
