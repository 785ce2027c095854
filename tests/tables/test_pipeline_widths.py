"""Tables of their own width and sparse optimizer through the pipeline (issue 43): a dim-4 sum
table, a dim-16 mean table of multi-hot lists and a dim-8 table with its own Adam learning rate
train through MEM-PS, SSD-PS and the trainer and equal the reference trainer to the bit."""

from __future__ import annotations

import numpy as np
import pytest

from hpsray.reference import ReferenceTrainer
from hpsray.tables import TableSpec

from small_pipeline import GEN as SMALL  # tests/small_pipeline.py
from small_pipeline import small_config, small_pipeline

THREE = (
    TableSpec("small", (0, 2), 4),
    TableSpec("lists", (1,), 16, "mean"),
    TableSpec("ids", (3,), 8, optimizer="adam", lr=0.02),
)


def reference_rows(ref: ReferenceTrainer, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference's rows of every table, padded with zeros to ``width``, by sorted key."""
    tables = ref.export_tables()
    keys = np.concatenate([k for k, _ in tables.values()])
    rows = np.zeros((keys.size, width), np.float32)
    at = 0
    for _, r in tables.values():
        rows[at : at + r.shape[0], : r.shape[1]] = r
        at += r.shape[0]
    order = np.argsort(keys)
    return keys[order], rows[order]


def test_three_widths_train_through_ssd_and_equal_the_reference(ray_local, tmp_path):
    from hpsray.export import export, load_export
    from hpsray.pipelines import SyntheticSource
    from hpsray.reference_job import export as reference_export
    from hpsray.serving import ServableModel

    cfg = small_config(minibatch_size=100, tables=THREE)
    assert cfg.row_width == 32  # the working set's: the lists' 16 weights and 16 Adagrad sums
    source, held_out = SyntheticSource(SMALL, rows=3000), SyntheticSource(SMALL, rows=400, start_row=10_000)
    # MEM-PS of 2,000 rows against ~6,000 distinct keys: rows go to SSD-PS and come back
    with small_pipeline(source, cfg, mem_rows=2000, ssd_dir=tmp_path / "ssd", ssd_options=dict(rows_per_file=256)) as p:
        report = p.fit(progress=False)
        scores = p.evaluate(held_out)
        keys, rows = p.export_rows()
        dense = p.dense_state()
        manifest = export(p, tmp_path / "model", cfg)
    assert report["ssd"]["bytes_written"] > 0, "the budget should have forced rows out to SSD-PS"
    ref = ReferenceTrainer(source.n_slots, source.n_dense, cfg)
    ref.fit(source.open(500))
    want_keys, want_rows = reference_rows(ref, cfg.row_width)
    np.testing.assert_array_equal(keys, want_keys)
    assert set(np.unique(keys >> np.uint64(56)).tolist()) == {0, 1, 2}
    np.testing.assert_array_equal(rows, want_rows)  # atol 0, each table at its width, zeros past it
    for name, value in ref.dense_state().items():
        np.testing.assert_array_equal(dense[name].numpy(), value.numpy(), err_msg=name)
    want = ref.evaluate(held_out.open(500))
    assert scores["examples"] == 400 and scores["auc"] == pytest.approx(want.auc, abs=1e-12)
    # the per-table report: rows created by each table, at its own row bytes
    tables = cfg.tables_for(source.n_slots)
    per_table = np.bincount((keys >> np.uint64(56)).astype(np.int64), minlength=3)
    figures = report["tables"]
    assert [f["rows_created"] for f in figures.values()] == per_table.tolist()
    assert [f["row_bytes"] for f in figures.values()] == list(tables.row_bytes) == [32, 128, 96]
    # stored at their widths: SSD-PS files of each group's rows in its own directory
    from hpsray.tiers.ssd.paramfile import read_index, record_bytes

    widths_on_disk: dict[str, set[int]] = {}
    for path in sorted((tmp_path / "ssd").rglob("*.hps")):
        widths_on_disk.setdefault(path.parent.name, set()).add(read_index(str(path)).header.width)
    assert widths_on_disk == {"group-0-width-8": {8}, "group-1-width-32": {32}, "group-2-width-24": {24}}
    caches = report["cache"]["groups"]  # one node: its MEM-PS,: a cache per group, rows at its width
    assert [c["width"] for c in caches] == [8, 32, 24] and all(c["size"] > 0 for c in caches)
    live = [f["ssd_live_rows"] for f in figures.values()]
    assert sum(live) > 0
    assert [f["ssd_live_bytes"] for f in figures.values()] == [n * record_bytes(w) for n, w in zip(live, (8, 32, 24))]
    # the export: weights 16 wide (zeros past a table's dim), state 16 wide; equal to the reference's
    assert (manifest["dim"], manifest["state_width"]) == (16, 16)
    assert [t["dim"] for t in manifest["tables"]] == [4, 16, 8]
    export(reference_export(ref), tmp_path / "reference", cfg, n_slots=source.n_slots, n_dense=source.n_dense)
    got, want_export = load_export(tmp_path / "model"), load_export(tmp_path / "reference")
    np.testing.assert_array_equal(got[0], want_export[0])
    np.testing.assert_array_equal(got[1], want_export[1])
    small = got[0] >> np.uint64(56) == 0
    assert not got[1][small, 4:16].any() and not got[1][small, 20:].any()  # a dim-4 Adagrad row: 4 + 4
    # served from the export: each slot pooled at its table's dim, unseen keys initialised by table
    model = ServableModel.load(str(tmp_path / "model"))
    for batch in held_out.open(200):
        np.testing.assert_allclose(model.predict(batch), ref.predict(batch), rtol=0, atol=1e-6)


def test_three_widths_recover_from_killed_actors_equal_to_the_reference(ray_local, tmp_path):
    """Every stage actor killed once during fit(): MEM-PS and SSD-PS come back from the last
    checkpoint's snapshot (a subdirectory per row group), and the run ends with the reference's
    rows of each table, at its width."""
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import (
        CheckpointSettings,
        MemPSSettings,
        Pipeline,
        SSDPSSettings,
        SyntheticSource,
        TrainerSettings,
    )

    from recovery_drivers import Killer, kill_plan  # tests/recovery_drivers.py

    source = SyntheticSource(PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=3, seed=5), rows=12000)
    cfg = small_config(minibatch_size=250, sparse_lr=0.05, tables=THREE)
    plan = kill_plan(17, 1, 24)
    ckpt = tmp_path / "ckpt"
    pipeline = Pipeline(
        source,
        TrainerSettings(cfg),
        MemPSSettings(capacity_rows=2000),  # split among three caches: each holds its in-flight batches
        SSDPSSettings(str(tmp_path / "ssd"), options=dict(rows_per_file=256)),
        batch_size=500,
        checkpoint=CheckpointSettings(str(ckpt), every_batches=2, keep=2, max_failures=len(plan)),
    )
    pipeline._start()
    killer = Killer(pipeline, ckpt, plan, 17)
    report = killer.fit()
    with pipeline:
        assert len(report["recovery"]) == len(killer.killed) == len(plan)
        assert report["batches"] == 24 and report["examples"] == source.rows
        keys, rows = pipeline.export_rows()
    ref = ReferenceTrainer(source.n_slots, source.n_dense, cfg)
    ref.fit(source.open(500))
    want_keys, want_rows = reference_rows(ref, cfg.row_width)
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_array_equal(rows, want_rows)
