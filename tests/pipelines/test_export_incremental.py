"""Incremental exports: deltas beside a full export, applied in order by ``load_export``."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from hpsray.config import TrainConfig
from hpsray.errors import ExportError
from hpsray.export import compare_exports, export, export_chain, load_export

CONFIG = TrainConfig(dim=4, hidden=(8,), sparse_optimizer="adagrad")  # rows: 4 weights + 4 accumulators
WIDTH = CONFIG.row_width


def model_states(n_steps: int = 4, seed: int = 0):
    """A model evolving as training would: some rows change, new keys appear, a few go away."""
    rng = np.random.default_rng(seed)
    keys = rng.choice(10**9, 300, replace=False).astype(np.uint64)
    rows = rng.standard_normal((keys.size, WIDTH)).astype(np.float32)
    out = []
    for step in range(n_steps):
        dense = {"layer.weight": torch.full((3, 2), float(step)), "layer.bias": torch.arange(3.0) + step}
        perm = rng.permutation(keys.size)  # any order: export sorts
        out.append((keys[perm].copy(), rows[perm].copy(), dense))
        touched = rng.choice(keys.size, 40, replace=False)
        rows[touched] += 0.5
        gone = rng.choice(keys.size, 5, replace=False)
        keep = np.ones(keys.size, bool)
        keep[gone] = False
        new = rng.choice(10**9, 20, replace=False).astype(np.uint64) + np.uint64(10**9)
        keys = np.concatenate([keys[keep], new])
        rows = np.concatenate([rows[keep], rng.standard_normal((20, WIDTH)).astype(np.float32)])
    return out


def assert_same(a, b) -> None:
    ka, ra, da = a
    kb, rb, db = b
    assert np.array_equal(ka, kb) and np.array_equal(ra, rb)
    assert set(da) == set(db) and all(torch.equal(da[n], db[n]) for n in da)
    d = compare_exports(a, b)
    assert d["max_abs_row_diff"] == 0.0 and d["max_abs_dense_diff"] == 0.0
    assert d["keys_only_in_a"] == d["keys_only_in_b"] == 0


def changed_rows(before, after) -> int:
    """Rows of ``after`` that are new or differ from ``before`` (a plain dict comparison)."""
    old = {int(k): r.tobytes() for k, r in zip(before[0], before[1])}
    return sum(old.get(int(k)) != r.tobytes() for k, r in zip(after[0], after[1]))


def test_incremental_exports_applied_in_order_equal_a_full_export_of_the_final_state(tmp_path):
    states = model_states(4)
    inc = tmp_path / "inc"
    first = export(states[0], inc, CONFIG, incremental=True)  # nothing there yet: a full export
    assert first["format"] == "hpsray-export" and "export_id" in first
    for step, state in enumerate(states[1:], start=1):
        m = export(state, inc, CONFIG, incremental=True, rows_per_file=25)
        assert m["format"] == "hpsray-export-delta" and m["sequence"] == step and m["base"] == first["export_id"]
        assert m["rows"] == state[0].size and m["removed"] == 5
        assert m["changed"] == changed_rows(states[step - 1], state) < state[0].size // 3  # only what changed
        export(state, tmp_path / f"full{step}", CONFIG)
        assert_same(load_export(inc), load_export(tmp_path / f"full{step}"))
    assert export_chain(inc) == [str(inc)] + [str(inc / f"delta-{i:06d}") for i in (1, 2, 3)]
    assert sorted(os.listdir(inc / "delta-000001")) == [
        "dense.pt",
        "manifest.json",
        "removed-00000.parquet",
        "rows-00000.parquet",
        "rows-00001.parquet",
        "rows-00002.parquet",
    ]
    base_only = load_export(inc, deltas=False)
    assert compare_exports(base_only, load_export(tmp_path / "full1"))["keys_only_in_a"] == 5


def test_an_unchanged_model_writes_an_empty_delta(tmp_path):
    (state,) = model_states(1)
    export(state, tmp_path / "e", CONFIG)
    m = export(state, tmp_path / "e", CONFIG, incremental=True)
    assert m["changed"] == m["removed"] == 0 and m["files"] == [] and m["removed_files"] == []
    assert_same(load_export(tmp_path / "e"), load_export(tmp_path / "e", deltas=False))


def test_an_interrupted_delta_is_ignored_with_a_warning_then_replaced(tmp_path, caplog):
    states = model_states(4)
    d = tmp_path / "e"
    export(states[0], d, CONFIG)
    export(states[1], d, CONFIG, incremental=True)
    export(states[2], d, CONFIG, incremental=True)
    os.remove(d / "delta-000002" / "manifest.json")  # as if the export stopped before its manifest
    with caplog.at_level(logging.WARNING, logger="hpsray.export"):
        got = load_export(d)
    assert "delta-000002/manifest.json: missing (an interrupted incremental export)" in caplog.text
    export(states[1], tmp_path / "full", CONFIG)
    assert_same(got, load_export(tmp_path / "full"))
    m = export(states[3], d, CONFIG, incremental=True)  # takes the interrupted one's place
    assert m["sequence"] == 2
    export(states[3], tmp_path / "full", CONFIG)
    assert_same(load_export(d), load_export(tmp_path / "full"))


def test_deltas_after_a_broken_one_and_of_another_export_are_ignored(tmp_path, caplog):
    states = model_states(3)
    d = tmp_path / "e"
    export(states[0], d, CONFIG)
    export(states[1], d, CONFIG, incremental=True)
    export(states[2], d, CONFIG, incremental=True)
    os.remove(d / "delta-000001" / "manifest.json")
    with caplog.at_level(logging.WARNING, logger="hpsray.export"):
        got = load_export(d)
    assert "and the deltas after it" in caplog.text and "delta-000002" in caplog.text
    assert_same(got, load_export(d, deltas=False))
    caplog.clear()
    other = tmp_path / "other"  # a delta copied from another export: another base
    export(states[0], other, CONFIG)
    export(states[1], other, CONFIG, incremental=True)
    os.rename(d / "delta-000001", tmp_path / "broken")
    os.rename(d / "delta-000002", tmp_path / "later")
    os.rename(other / "delta-000001", d / "delta-000001")
    with caplog.at_level(logging.WARNING, logger="hpsray.export"):
        assert_same(load_export(d), load_export(d, deltas=False))
    assert "a delta of another export" in caplog.text


def test_a_full_export_replaces_the_deltas(tmp_path):
    states = model_states(3)
    d = tmp_path / "e"
    export(states[0], d, CONFIG)
    export(states[1], d, CONFIG, incremental=True)
    m = export(states[2], d, CONFIG)
    assert not [n for n in os.listdir(d) if n.startswith("delta-")]
    assert export_chain(d) == [str(d)] and json.loads((d / "manifest.json").read_text()) == m
    keys, rows, dense = states[2]
    order = np.argsort(keys)
    assert_same(load_export(d), (keys[order], rows[order], dense))


def test_an_incremental_export_of_another_shape_is_refused(tmp_path):
    (state,) = model_states(1)
    export(state, tmp_path / "e", CONFIG)
    other = TrainConfig(dim=2, hidden=(8,), sparse_optimizer="adagrad_row")
    keys = state[0]
    with pytest.raises(ExportError, match="an incremental export of dim 2 and width 3 cannot go on top of it"):
        export((keys, np.zeros((keys.size, 3), np.float32), state[2]), tmp_path / "e", other, incremental=True)
    assert not (tmp_path / "e" / "delta-000001").exists()


def test_compare_says_how_many_rows_differ_and_whether_by_rounding():
    rng = np.random.default_rng(4)
    keys = np.arange(1, 101, dtype=np.uint64)
    rows = rng.standard_normal((100, 4)).astype(np.float32)
    dense = {"w": torch.from_numpy(rng.standard_normal(6).astype(np.float32))}
    same = compare_exports((keys, rows, dense), (keys[::-1].copy(), rows[::-1].copy(), dense))
    assert same["rows_differing"] == 0 and same["max_ulps"] == 0 and same["max_rel_diff"] == 0.0
    nudged = rows.copy()
    nudged[[3, 50]] = np.nextafter(nudged[[3, 50]], np.float32(np.inf))  # one ulp up
    nudged[50, 1] = np.nextafter(np.nextafter(nudged[50, 1], np.float32(np.inf)), np.float32(np.inf))
    d = compare_exports((keys, rows, dense), (keys, nudged, dense))
    assert d["rows_differing"] == 2 and d["max_ulps"] == 3
    assert 0 < d["max_rel_diff"] < 1e-6
    wrong = rows.copy()
    wrong[7, 0] = -wrong[7, 0]  # a sign flipped: far beyond rounding
    d = compare_exports((keys, rows, dense), (keys, wrong, dense))
    assert d["rows_differing"] == 1 and d["max_ulps"] > 2**24 and d["max_rel_diff"] == pytest.approx(2.0)
    zeros = np.zeros((100, 4), np.float32)
    assert compare_exports((keys, zeros, dense), (keys, -zeros, dense))["max_ulps"] == 0  # -0.0 is 0.0
