"""Serving follows training through incremental exports: ``delta-NNNNNN/`` beside a full export.

A served model is the state after the last delta that applies (docs/export.md): its rows (point
store and hot-row cache) and its dense weights (the newest delta's). Predictions after a delta
equal the reference trainer's in its new state; the point store of a delta, merged from the
previous state's, equals one laid out from ``load_export``. (Over HTTP, under a request stream:
``test_http.py::test_hot_swap_to_a_new_delta_loses_no_request``.)
"""

from __future__ import annotations

import copy
import os
import shutil

import numpy as np
import pytest
from conftest import close, raw_examples

from hpsray.serving import LoadOptions, ServableModel, resolve_export
from hpsray.serving.layout import build_point_store, point_store_dir, read_meta
from hpsray.serving.model import export_version
from hpsray.serving.pointstore import PointStore


def reference_of(trained, keys, rows, dense):
    """A reference trainer holding exactly the state ``(keys, rows, dense)``."""
    from hpsray.reference import SortedRowStore

    t = copy.deepcopy(trained)
    t.store = SortedRowStore(t.config.row_width, t.config.row_init())
    t.store.write(t.store.positions(np.asarray(keys, np.uint64)), rows)
    t.model.load_state_dict(dense)
    return t


def _copy(exports, tmp_path, name="model") -> str:
    d = str(tmp_path / name)
    shutil.copytree(exports["parquet"], d, ignore=shutil.ignore_patterns("point"))
    return d


def _delta(state, directory, config) -> dict:
    from hpsray.export import export

    return export(state, directory, config, incremental=True)


def _layout(directory):
    store = PointStore(build_point_store(directory))
    try:
        return np.array(store.keys), store.read_all()
    finally:
        store.close()


@pytest.mark.parametrize("mem", [None, 0.05])
def test_predictions_after_deltas_equal_the_reference_in_its_new_state(
    planted, trained, retrained, exports, tmp_path, mem
):
    d = _copy(exports, tmp_path)
    batch, _ = raw_examples(planted, 400, start_block=100_030)
    model0 = ServableModel.load(d, LoadOptions(mem_fraction=mem))
    assert model0.delta == 0 and close(model0.predict(batch), trained.predict(batch))

    # delta 1: training went on (rows changed, keys added, dense weights moved)
    m1 = _delta(retrained.export(), d, retrained.config)
    assert m1["sequence"] == 1 and 0 < m1["changed"] < m1["rows"]
    model1 = ServableModel.load(d, LoadOptions(mem_fraction=mem), previous=model0)
    assert model1.delta == 1 and model1.rows == m1["rows"] and model1.version != model0.version
    want1 = retrained.predict(batch)
    assert not close(want1, trained.predict(batch))
    for _ in range(2):  # cold (carried-over) cache, then warm
        assert close(model1.predict(batch), want1)

    # delta 2: some keys removed (served as unseen: initial rows), others changed, dense changed
    keys, rows, dense = retrained.export()
    rng = np.random.default_rng(4)
    keep = rng.random(keys.size) > 0.2
    rows = rows.copy()
    rows[rng.random(keys.size) < 0.1, : retrained.config.dim] *= -2.0
    dense = {k: v * 0.9 for k, v in dense.items()}
    m2 = _delta((keys[keep], rows[keep], dense), d, retrained.config)
    assert m2["sequence"] == 2 and m2["removed"] > 0
    model2 = ServableModel.load(d, LoadOptions(mem_fraction=mem), previous=model1)
    ref2 = reference_of(trained, keys[keep], rows[keep], dense)
    want2 = ref2.predict(batch)
    assert model2.delta == 2 and not close(want2, want1)
    for _ in range(2):
        assert close(model2.predict(batch), want2)
    if mem is not None:
        assert model2.lookup.carried > 0  # the swap did not start cold
        removed = keys[~keep]
        cached = model1.lookup.cache.keys
        assert np.isin(removed, cached).any() and not np.isin(removed, model2.lookup.cache.keys).any()


def test_carried_cache_serves_the_rows_of_the_new_state(trained, retrained, exports, tmp_path):
    d = _copy(exports, tmp_path)
    keys0, rows0, _ = trained.export()
    model0 = ServableModel.load(d, LoadOptions(mem_fraction=0.2))
    hot = keys0[:: max(1, keys0.size // 500)]
    for _ in range(3):
        model0.lookup.rows(hot)  # admitted, then hot
    assert (model0.lookup.cache.probe(hot) >= 0).mean() > 0.5
    _delta(retrained.export(), d, retrained.config)
    model1 = ServableModel.load(d, LoadOptions(mem_fraction=0.2), previous=model0)
    keys1, rows1, _ = retrained.export()
    slots = model1.lookup.cache.probe(hot)
    assert (slots >= 0).mean() > 0.5  # the hot keys are still hot after the swap
    got = np.empty((hot.size, 8), np.float32)
    model1.lookup.cache.gather(slots, got)
    idx = np.searchsorted(keys1, hot)
    where = slots >= 0
    assert np.array_equal(got[where], rows1[idx[where], :8])  # the new rows, not the old ones
    changed = ~np.all(rows0[np.searchsorted(keys0, hot)][:, :8] == rows1[idx][:, :8], axis=1)
    assert (changed & where).any()


def _state_config(dim=4):
    from hpsray.config import TrainConfig

    return TrainConfig(dim=dim, hidden=(8,), sparse_optimizer="sgd", seed=1)


def test_delta_layouts_merge_and_equal_a_layout_of_load_export(tmp_path, monkeypatch):
    """Keys removed then added again, added then removed, changed twice; the layout built delta by
    delta, all at once from the base's, and rebuilt from nothing all equal ``load_export``'s rows;
    merging in chunks smaller than the store gives the same bytes."""
    import torch

    import hpsray.serving.layout as layout
    from hpsray.export import export, load_export

    config = _state_config()
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(1, 2**63, 5000, dtype=np.uint64))
    rows = rng.standard_normal((keys.size, 4)).astype(np.float32)
    dense = {"w": torch.zeros(3)}
    d = str(tmp_path / "m")
    export((keys, rows, dense), d, config, n_slots=2, n_dense=1, rows_per_file=1500)
    _layout(d)
    states = []
    # delta 1: remove a, add b (new, below and above every key too), change c
    a, c = keys[10:20], keys[100:130]
    b = np.array([0, 2**64 - 2, *rng.integers(1, 2**63, 40, dtype=np.uint64)], np.uint64)
    k1 = np.setdiff1d(np.union1d(keys, b), a)
    r1 = np.zeros((k1.size, 4), np.float32)
    old = np.isin(k1, keys)
    r1[old] = rows[np.searchsorted(keys, k1[old])]
    r1[~old] = 7.0
    r1[np.isin(k1, c)] += 1.0
    states.append((k1, r1))
    # delta 2: a back, b removed, c changed again
    k2 = np.setdiff1d(np.union1d(k1, a), b)
    r2 = np.zeros((k2.size, 4), np.float32)
    in1 = np.isin(k2, k1)
    r2[in1] = r1[np.searchsorted(k1, k2[in1])]
    r2[~in1] = -3.0
    r2[np.isin(k2, c)] += 1.0
    states.append((k2, r2))

    for k, r in states:  # delta by delta, a layout after each
        export((k, r, dense), d, config, incremental=True, rows_per_file=1500)
        got_k, got_r = _layout(d)
        want_k, want_r, _ = load_export(d)
        assert np.array_equal(got_k, k) and np.array_equal(got_k, want_k)
        assert np.array_equal(got_r, want_r[:, :4])
    meta = read_meta(point_store_dir(os.path.join(d, "delta-000002")))
    assert meta["delta"] == 2
    assert not os.path.exists(point_store_dir(d))  # older than the previous layout: pruned
    want_k, want_r, _ = load_export(d)

    # both deltas at once, from the base's layout
    e = str(tmp_path / "e")
    shutil.copytree(d, e, ignore=shutil.ignore_patterns("point"))
    build_point_store(e, chain=[e])  # the base's layout alone
    monkeypatch.setattr(layout, "MERGE_CHUNK_ROWS", 1000)  # several chunks
    got_k, got_r = _layout(e)
    assert np.array_equal(got_k, want_k) and np.array_equal(got_r, want_r[:, :4])
    # rebuilt from nothing
    path = build_point_store(e, rebuild=True)
    store = PointStore(path)
    assert np.array_equal(np.array(store.keys), want_k) and np.array_equal(store.read_all(), want_r[:, :4])
    store.close()


def test_version_follows_deltas_and_ignores_one_being_written(trained, retrained, exports, tmp_path):
    from hpsray.export import export

    root = tmp_path / "models"
    d1 = _copy(exports, root, "v1")
    d2 = _copy(exports, root, "v2")
    newer = os.stat(d1 + "/manifest.json").st_mtime_ns + 10**9
    os.utime(os.path.join(d2, "manifest.json"), ns=(newer, newer))
    assert resolve_export(root) == d2
    v0 = export_version(d1)
    os.makedirs(os.path.join(d1, "delta-000001"))  # being written: no manifest yet
    assert export_version(d1) == v0
    shutil.rmtree(os.path.join(d1, "delta-000001"))
    export(retrained.export(), d1, retrained.config, incremental=True)
    assert export_version(d1) != v0 and len(export_version(d1)[2]) == 1
    os.utime(
        os.path.join(d1, "delta-000001", "manifest.json"), ns=(os.stat(d2 + "/manifest.json").st_mtime_ns + 1,) * 2
    )
    v1 = export_version(d1)
    assert resolve_export(root) == d1  # a delta just landed there: the newest
    os.makedirs(os.path.join(d1, "delta-000002"))  # interrupted: ignored (load_export warns)
    model = ServableModel.load(root)
    assert model.directory == d1 and model.delta == 1 and model.version == v1
    assert model.stats()["delta"] == 1


def test_a_second_builder_keeps_the_store_already_published(exports, tmp_path):
    """Replicas build the same store at once: the one that lands second keeps the first's (which
    a replica may be opening), instead of deleting it under it; an explicit rebuild replaces it."""
    from hpsray.serving.layout import _publish

    d = _copy(exports, tmp_path)
    target = build_point_store(d)
    inode = os.stat(os.path.join(target, "rows.f32")).st_ino
    late = target + ".tmp-late"
    shutil.copytree(target, late)
    _publish(late, target)
    assert not os.path.exists(late) and os.stat(os.path.join(target, "rows.f32")).st_ino == inode
    shutil.copytree(target, late)
    _publish(late, target, replace=True)
    assert os.stat(os.path.join(target, "rows.f32")).st_ino != inode
