"""Exports in object storage (hpsray/export/remote.py; issue 45) against a real S3 server (moto):
``export`` to a URI, a delta on top, and serving's loader reading the URI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpsray.config import TrainConfig
from hpsray.data import Schema
from hpsray.errors import ServingError
from hpsray.export import export, load_export
from hpsray.serving import ServableModel, resolve_export

CFG = TrainConfig(dim=4, hidden=(8,), sparse_optimizer="adagrad", sparse_lr=0.05)


def _model(n: int, seed: int) -> tuple:
    """A trained model (a reference trainer over ``n`` planted examples): keys, rows, dense."""
    from hpsray.data import PlantedCTR
    from hpsray.reference import ReferenceTrainer

    trainer = ReferenceTrainer(2, 1, CFG)
    trainer.fit(PlantedCTR(n_slots=2, keys_per_slot=100, n_dense=1, seed=seed).batches(n, 250))
    return trainer.export()


def test_export_to_a_uri_with_a_delta_loads_and_serves(s3_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("HPSRAY_EXPORT_CACHE", str(tmp_path / "cache"))
    uri = s3_uri.replace("/ckpts?", "/model?")
    with pytest.raises(ServingError, match="no export there"):
        resolve_export(uri)
    schema = Schema.criteo(1, 2)
    keys, rows, dense = _model(1000, 0)
    export((keys, rows, dense), uri, CFG, n_slots=2, n_dense=1, schema=schema, rows_per_file=200)
    local = resolve_export(uri)
    got_keys, got_rows, got_dense = load_export(local)
    order = np.argsort(keys)
    assert np.array_equal(got_keys, keys[order]) and np.array_equal(got_rows, rows[order])
    assert all(torch.equal(got_dense[k], v) for k, v in dense.items())
    # a delta: changed rows and a new dense; the served copy follows once it is there
    rows2 = rows.copy()
    rows2[:7] += 1
    dense2 = {k: v + 1 for k, v in dense.items()}
    export((keys, rows2, dense2), uri, CFG, incremental=True)
    again = resolve_export(uri)
    assert again == local  # the same cache directory, downloaded anew
    got_keys, got_rows, got_dense = load_export(again)
    assert np.array_equal(got_rows, rows2[order]) and all(torch.equal(got_dense[k], v) for k, v in dense2.items())
    model = ServableModel.load(uri)  # what hpsray serve s3://... loads
    assert model.version == ServableModel.load(again).version


def test_an_unchanged_export_is_not_downloaded_again(s3_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("HPSRAY_EXPORT_CACHE", str(tmp_path / "cache"))
    uri = s3_uri.replace("/ckpts?", "/m?")
    export(_model(50, 1), uri, CFG, n_slots=2, n_dense=1)
    local = resolve_export(uri)
    (tmp_path / "cache" / local.rsplit("/", 1)[1] / "mark").write_text("x")  # a download would replace the copy
    assert resolve_export(uri) == local and (tmp_path / "cache" / local.rsplit("/", 1)[1] / "mark").exists()
    export(_model(50, 2), uri, CFG, n_slots=2, n_dense=1)  # a new export: downloaded again
    assert resolve_export(uri) == local and not (tmp_path / "cache" / local.rsplit("/", 1)[1] / "mark").exists()
