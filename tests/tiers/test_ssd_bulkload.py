"""Bulk-loading a Parquet table into SSD-PS (``[tiers] init_from``) and the compact key map."""

import json
import os
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpsray.errors import SSDError, TableImportError
from hpsray.tiers.ssd import SSDPS, TableImport, read_table
from hpsray.tiers.ssd.keymap import KeyMap

DIM, STATE = 4, 4
WIDTH = DIM + STATE


def _table(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**62, size=n, replace=False).astype(np.uint64)
    rows = rng.standard_normal((n, WIDTH)).astype(np.float32)
    return keys, rows


def _fixed(values: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def write_parquet(directory, keys, rows, parts=3, state=True, manifest=True, row_col="weights") -> list[str]:
    """An export-like directory: ``parts`` files, ``manifest.json`` (as hpsray's export writes) when asked."""
    os.makedirs(directory, exist_ok=True)
    names = []
    for i, (k, r) in enumerate(zip(np.array_split(keys, parts), np.array_split(rows, parts))):
        cols = {"key": pa.array(k, pa.uint64()), row_col: _fixed(r[:, :DIM])}
        if state:
            cols["state"] = _fixed(r[:, DIM:])
        name = f"rows-{i:05d}.parquet"
        pq.write_table(pa.table(cols), os.path.join(directory, name))
        names.append(name)
    if manifest:
        files = [{"path": n, "rows": int(k.size)} for n, k in zip(names, np.array_split(keys, parts))]
        meta = {"format": "hpsray-export", "version": 1, "dim": DIM, "state_width": STATE, "files": files}
        with open(os.path.join(directory, "manifest.json"), "w") as f:
            json.dump(meta, f)
    return [os.path.join(directory, n) for n in names]


def _param_files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith((".hps", ".tmp")))


def test_an_export_loads_row_for_row_and_survives_reopen(tmp_path):
    keys, rows = _table(20_000)
    write_parquet(tmp_path / "export", keys, rows)
    with SSDPS(str(tmp_path / "ssd"), WIDTH, rows_per_file=3000) as store:
        done = store.bulk_load(TableImport(str(tmp_path / "export"), DIM))
        assert done["rows"] == 20_000 and done["files"] == 7 and done["source_files"] == 3
        got, found = store.load(keys[::-1])
        assert found.all()
        np.testing.assert_array_equal(got, rows[::-1])
        # an imported store is an ordinary store: overwrite, compact, reopen
        store.dump(keys[:5000], rows[:5000] + 1)
        store.compact(full=True)
    with SSDPS(str(tmp_path / "ssd")) as again:
        assert len(again) == 20_000
        got, found = again.load(keys)
        assert found.all()
        np.testing.assert_array_equal(got[:5000], rows[:5000] + 1)
        np.testing.assert_array_equal(got[5000:], rows[5000:])


def test_plain_parquet_without_state_or_manifest_starts_rows_with_the_initial_state(tmp_path):
    keys, rows = _table(1000)
    d = tmp_path / "plain"
    os.makedirs(d)
    # a variable-length list column named "row", signed keys: what other tools write
    weights = pa.array(list(rows[:, :DIM]), pa.list_(pa.float64()))
    pq.write_table(pa.table({"key": pa.array(keys.astype(np.int64)), "row": weights}), d / "part-0.parquet")
    with SSDPS(str(tmp_path / "ssd"), WIDTH) as store:
        store.bulk_load(TableImport(str(d), DIM, state_value=0.1))
        got, found = store.load(keys)
    assert found.all()
    np.testing.assert_array_equal(got[:, :DIM], rows[:, :DIM])
    assert (got[:, DIM:] == np.float32(0.1)).all()
    k2, r2 = read_table(str(d), DIM, WIDTH, 0.1, keys=keys[::3])
    np.testing.assert_array_equal(k2, np.sort(keys[::3]))
    np.testing.assert_array_equal(r2, got[::3][np.argsort(keys[::3])])


def _refuses(tmp_path, src, match: str) -> None:
    """The import fails with ``match`` and leaves an empty store: no file, no key, also after reopen."""
    ssd = tempfile.mkdtemp(dir=tmp_path, prefix="ssd-")
    with SSDPS(ssd, WIDTH, rows_per_file=500) as store:
        with pytest.raises(TableImportError, match=match):
            store.bulk_load(TableImport(str(src), DIM))
        assert len(store) == 0 and _param_files(ssd) == []
        store.dump(np.array([1], np.uint64), np.ones((1, WIDTH), np.float32))  # still usable
    with SSDPS(ssd) as again:
        assert len(again) == 1


def test_a_malformed_file_is_named_and_nothing_is_half_loaded(tmp_path):
    keys, rows = _table(6000)
    paths = write_parquet(tmp_path / "export", keys, rows)
    k, r = keys[4000:], rows[4000:]  # the last file: rows one float short
    pq.write_table(
        pa.table({"key": pa.array(k), "weights": _fixed(r[:, : DIM - 1]), "state": _fixed(r[:, DIM:])}), paths[2]
    )
    _refuses(tmp_path, tmp_path / "export", r"rows-00002\.parquet: column 'weights' holds 3 floats per row, expected 4")


def test_a_partial_export_is_refused(tmp_path):
    keys, rows = _table(6000)
    paths = write_parquet(tmp_path / "export", keys, rows)
    t = pq.read_table(paths[1])
    pq.write_table(t.slice(0, 100), paths[1])  # cut short
    _refuses(tmp_path, tmp_path / "export", r"rows-00001\.parquet: 100 rows, the export's manifest says 2000")
    os.unlink(paths[2])
    _refuses(tmp_path, tmp_path / "export", r"rows-00002\.parquet: listed in .*manifest.json but missing")


def test_duplicate_keys_and_missing_columns_are_refused(tmp_path):
    keys, rows = _table(3000)
    keys[2500] = keys[10]  # in the second half, a key of the first
    write_parquet(tmp_path / "dup", keys, rows, parts=2, manifest=False)
    _refuses(tmp_path, tmp_path / "dup", rf"rows-00001\.parquet: key {int(keys[10])} appears more than once")
    write_parquet(tmp_path / "nokey", keys[:10], rows[:10], parts=1, manifest=False, row_col="embedding")
    _refuses(tmp_path, tmp_path / "nokey", r"rows-00000\.parquet: no 'row' \(or 'weights'\) column")
    with open(tmp_path / "nokey" / "rows-00000.parquet", "wb") as f:
        f.write(b"not parquet")
    _refuses(tmp_path, tmp_path / "nokey", r"rows-00000\.parquet: not a readable Parquet file")


def test_only_an_empty_store_imports(tmp_path):
    keys, rows = _table(100)
    write_parquet(tmp_path / "export", keys, rows, parts=1)
    with SSDPS(str(tmp_path / "ssd"), WIDTH) as store:
        store.dump(keys[:1], rows[:1])
        with pytest.raises(SSDError, match="already holds 1 rows"):
            store.bulk_load(TableImport(str(tmp_path / "export"), DIM))


def test_key_map_stays_compact_and_agrees_with_a_dict_through_inserts_and_removals():
    rng = np.random.default_rng(3)
    km = KeyMap()
    model: dict[int, tuple[int, int]] = {}
    universe = np.unique(rng.integers(64, 2**63, size=20_000, dtype=np.uint64))
    universe[:64] = np.arange(64, dtype=np.uint64)  # consecutive keys: long probe runs to shift back
    for _ in range(60):
        ins = rng.choice(universe, size=1500)
        fs = rng.integers(0, 100, ins.size).astype(np.int32)
        ps = rng.integers(0, 1 << 20, ins.size).astype(np.int32)
        km.grow(ins.size)
        km.place(ins, fs, ps)
        for k, f, p in zip(ins.tolist(), fs.tolist(), ps.tolist()):
            model[k] = (f, p)  # the last duplicate wins
        gone = rng.choice(universe, size=700)
        removed, removed_fs = km.remove(np.unique(gone))
        for k, f in zip(removed.tolist(), removed_fs.tolist()):
            assert model.pop(k)[0] == f
        assert not any(k in model for k in np.unique(gone).tolist())
    assert km.size == len(model)
    slots = km.find(universe)
    present = np.array([k in model for k in universe.tolist()])
    np.testing.assert_array_equal(slots >= 0, present)
    want = np.array([model[k] for k in universe[present].tolist()])
    np.testing.assert_array_equal(km.file_slot[slots[present]], want[:, 0])
    np.testing.assert_array_equal(km.pos[slots[present]], want[:, 1])
    km2 = KeyMap()
    km2.grow(1_000_000)
    km2.place(np.arange(1, 1_000_001, dtype=np.uint64), np.int32(0), np.zeros(1_000_000, np.int32))
    assert km2.bytes_per_key <= 16 / 0.79  # 16 bytes a slot, sized once for the keys: 80 % full


def test_training_that_rewrites_imported_rows_does_not_grow_the_key_map(tmp_path):
    """An import sizes the key map once (80 % full); dumps of keys already stored take no slots,
    so they must not grow it by half (at 30M keys: 0.3 GB more, 1.7 GB for the moment of the
    rebuild, which is what an SSD-PS in a memory cgroup died of). New keys still grow it."""
    keys, rows = _table(20_000)
    write_parquet(tmp_path / "export", keys, rows)
    with SSDPS(str(tmp_path / "ssd"), WIDTH, rows_per_file=3000) as store:
        store.bulk_load(TableImport(str(tmp_path / "export"), DIM))
        imported = store.stats["key_map_bytes"]
        for start in range(0, 20_000, 4000):
            store.dump(keys[start : start + 4000], rows[start : start + 4000] + 1)
        assert store.stats["key_map_bytes"] == imported
        fresh = _table(8000, seed=1)[0]
        store.dump(fresh, np.zeros((fresh.size, WIDTH), np.float32))
        assert store.stats["key_map_bytes"] > imported
        got, found = store.load(np.concatenate([keys, fresh]))
        assert found.all()
        np.testing.assert_array_equal(got[:20_000], rows + 1)
