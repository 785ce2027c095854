"""Several tables of one width in the trainer and the pipeline (issue 43): keys tagged by the
readers, mean pooling in the step, equal to the reference trainer's tables bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.errors import ConfigError
from hpsray.kernels.init import initial_rows
from hpsray.models.pooling import BagLayout, bag_divisor
from hpsray.reference import ReferenceTrainer
from hpsray.reference_tables import pool
from hpsray.tables import TableSpec, TagKeys, check_tables, key_tagging
from hpsray.tiers.loans import Loan
from hpsray.training.engine import TrainerEngine

GEN = PlantedCTR(n_slots=4, keys_per_slot=80, nnz_per_slot=PlantedCTR.spread_nnz(4, 9), n_dense=3, seed=7)
# one width (the pipeline's tiers hold one), three tables: one of multi-hot lists averaged, one
# (ids) with its own learning rate
THREE = (TableSpec("a", (0, 2), 4), TableSpec("lists", (1,), 4, "mean"), TableSpec("ids", (3,), 4, lr=0.2))


def config(tables=THREE, **kw):
    return TrainConfig(**{"dim": 4, "hidden": (8,), "minibatch_size": 32, "tables": tables, **kw})


def test_bag_divisor_turns_sums_into_the_references_means():
    batch = GEN.generate(40)
    layout = BagLayout.of(batch)
    rows = torch.randn(len(layout.unique_keys), 4)
    mean = torch.tensor([False, True, False, True])
    divisor = bag_divisor(torch.as_tensor(layout.bag_offsets), len(layout.inverse), len(batch), mean)
    got = pool(rows, layout, "sum") / divisor
    assert torch.equal(got[:, mean], pool(rows, layout, "mean")[:, mean])
    assert torch.equal(got[:, ~mean], pool(rows, layout, "sum")[:, ~mean])  # a sum's bits untouched


def test_the_pipeline_runs_tables_of_one_width_or_of_their_own():
    check_tables(config(), 4)
    check_tables(config((TableSpec("all", (0, 1, 2, 3), 4, "mean"),)), 4)
    for own in (TableSpec("ids", (3,), 8), TableSpec("ids", (3,), 4, optimizer="adam")):
        check_tables(config((THREE[0], THREE[1], own)), 4)  # tests/tables/test_pipeline_widths.py
    assert key_tagging(config(()), 4) == [] and key_tagging(config((TableSpec("all", (0, 1, 2, 3), 4),)), 4) == []
    (tag,) = key_tagging(config(), 4)
    batch = GEN.generate(10)
    tagged = tag(batch)
    assert np.array_equal(tagged.keys, config().tables_for(4).tag(batch.keys, batch.slots))
    assert np.array_equal(tagged.labels, batch.labels) and tagged.keys is not batch.keys


@pytest.mark.parametrize("sparse", ["adagrad", "sgd", "adagrad_row", "adam"])
def test_the_engine_with_mean_pooling_equals_the_references_tables(sparse):
    cfg = config(sparse_optimizer=sparse)
    tables = cfg.tables_for(GEN.n_slots)
    tag = TagKeys(tables)
    batches = [GEN.generate(96) for _ in range(3)]
    ref = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)
    for b in batches:
        ref.train_batch(b)
    engine = TrainerEngine(cfg, GEN.n_slots, GEN.n_dense, capacity=4000)
    assert engine.mean_slots is not None and engine.mean_slots.tolist() == [False, True, False, False]
    assert engine.lr_by_tag is not None and engine.lr_by_tag[:3].tolist() == pytest.approx([cfg.sparse_lr] * 2 + [0.2])
    assert not engine.arena.fused  # one learning rate per fused update: the unfused ops
    rows: dict[int, np.ndarray] = {}
    for raw in batches:
        batch = tag(raw)
        keys = np.unique(batch.keys)
        start = initial_rows(keys, cfg.row_width, cfg.row_init())
        for i, k in enumerate(keys.tolist()):
            if k in rows:
                start[i] = rows[k]
        engine.borrow(0, [keys], [Loan(start)])
        engine.close_batch(engine.train_local(engine.index(batch)))
        rows.update(zip(keys.tolist(), engine.rows(keys), strict=True))
    for name, (keys, want) in ref.export_tables().items():
        got = np.stack([rows[k] for k in keys.tolist()])
        np.testing.assert_array_equal(got, want, err_msg=name)  # atol 0
    probe = GEN.generate(50)
    keys = np.array(sorted(rows), dtype=np.uint64)
    got = engine.predict(tag(probe), keys, np.stack([rows[k] for k in keys.tolist()]))
    np.testing.assert_array_equal(got, ref.predict(probe))  # evaluation pools by the mean too


def test_a_job_of_several_tables_cannot_import_untagged_rows(tmp_path):
    from hpsray.job import build
    from hpsray.job.jobconfig import JobConfig

    path = tmp_path / "job.toml"
    path.write_text(
        "[data.synthetic]\nrows = 100\nslots = 2\n\n[cluster]\nnodes = 1\n\n"
        f'[tiers]\ninit_from = "{tmp_path}/table"\n\n'
        '[[tables]]\nname = "a"\nslots = [0]\ndim = 8\n\n'
        '[[tables]]\nname = "b"\nslots = [1]\ndim = 8\npooling = "mean"\n'
    )
    with pytest.raises(ConfigError, match="tiers.init_from"):
        build.init_from(JobConfig.load(path))


def test_the_pipeline_trains_three_tables_through_ssd_and_equals_the_reference(ray_local, tmp_path):
    from hpsray.export import export
    from hpsray.pipelines import SyntheticSource
    from hpsray.pipelines.report import format_stage_table
    from hpsray.serving import ServableModel

    from small_pipeline import GEN as SMALL  # tests/small_pipeline.py
    from small_pipeline import small_config, small_pipeline

    cfg = small_config(minibatch_size=100, tables=THREE)
    source, held_out = SyntheticSource(SMALL, rows=3000), SyntheticSource(SMALL, rows=400, start_row=10_000)
    # MEM-PS of 2,000 rows against ~6,000 distinct keys: rows go to SSD-PS and come back
    with small_pipeline(source, cfg, mem_rows=2000, ssd_dir=tmp_path / "ssd", ssd_options=dict(rows_per_file=256)) as p:
        report = p.fit(progress=False)
        scores = p.evaluate(held_out)
        keys, rows = p.export_rows()
        dense = p.dense_state()
        manifest = export(p, tmp_path / "model", cfg)
    assert report["examples"] == 3000 and min(report["cache_hit_rate"].values()) < 1.0
    assert report["ssd"]["bytes_written"] > 0, "the budget should have forced rows out to SSD-PS"
    ref = ReferenceTrainer(source.n_slots, source.n_dense, cfg)
    ref.fit(source.open(500))
    tables = ref.export_tables()
    ref_keys = np.concatenate([k for k, _ in tables.values()])
    order = np.argsort(ref_keys)
    np.testing.assert_array_equal(keys, ref_keys[order])  # tagged: each key carries its table
    assert set(np.unique(keys >> np.uint64(56)).tolist()) == {0, 1, 2}
    # the report per table: every exported row was created once, by its table; MEM-PS's counts split
    figures = report["tables"]
    assert list(figures) == ["a", "lists", "ids"]
    per_table = np.bincount((keys >> np.uint64(56)).astype(np.int64), minlength=3)
    assert [f["rows_created"] for f in figures.values()] == per_table.tolist()
    assert all(f["bytes_created"] == f["rows_created"] * 4 * cfg.row_width for f in figures.values())
    cache = report["cache"]
    assert sum(f["lookups"] for f in figures.values()) == cache["hits"] + cache["misses"]
    assert sum(f["hits"] for f in figures.values()) == cache["hits"]
    assert sum(f["ssd_rows_loaded"] for f in figures.values()) == cache["loaded"] > 0
    assert "table lists: " in format_stage_table(report)
    np.testing.assert_array_equal(rows, np.concatenate([r for _, r in tables.values()])[order])  # atol 0
    for name, value in ref.dense_state().items():
        np.testing.assert_array_equal(dense[name].numpy(), value.numpy(), err_msg=name)
    want = ref.evaluate(held_out.open(500))
    assert scores["examples"] == 400 and scores["auc"] == pytest.approx(want.auc, abs=1e-12)
    # served from the export: requests' keys tagged and the lists averaged as in training
    assert [t["pooling"] for t in manifest["tables"]] == ["sum", "mean", "sum"]
    model = ServableModel.load(str(tmp_path / "model"))
    for batch in held_out.open(200):
        np.testing.assert_allclose(model.predict(batch), ref.predict(batch), rtol=0, atol=1e-6)


def test_serving_reads_the_tables_of_a_manifest_and_names_a_bad_one():
    from hpsray.serving.tables import SlotTables

    entries = config().tables_for(4).manifest()
    tables = SlotTables.from_manifest(entries, 4, "m.json")
    assert tables is not None and tables.slot_table.tolist() == [0, 1, 0, 2]
    assert tables.mean_slots.tolist() == [False, True, False, False]
    batch = GEN.generate(20)
    assert np.array_equal(tables.tag(batch).keys, config().tables_for(4).tag(batch.keys, batch.slots))
    assert SlotTables.from_manifest(None, 4, "m.json") is None  # an export before tables
    assert SlotTables.from_manifest([{"name": "all", "slots": [0, 1, 2, 3], "pooling": "sum"}], 4, "m.json") is None
    for bad, words in (
        ([{"name": "a", "slots": [0, 1], "pooling": "sum"}], "slots [2, 3] are in no table"),
        ([{"name": "a", "slots": [0, 1, 2, 4], "pooling": "sum"}], "out of range"),
        ([{"name": "a", "slots": [0, 1, 2, 3], "pooling": "max"}], "pooling 'max'"),
        ([{"name": "a", "pooling": "sum"}], "'slots'"),
    ):
        with pytest.raises(ValueError, match="m.json: tables: .*" + words.replace("[", r"\[").replace("]", r"\]")):
            SlotTables.from_manifest(bad, 4, "m.json")


def test_keys_are_counted_by_their_tag_without_a_pass_over_them():
    from hpsray.tiers.tagcount import by_tag

    rng = np.random.default_rng(0)
    keys = np.sort(rng.integers(0, 2**64 - 1, 5000, dtype=np.uint64, endpoint=False))
    keys = np.concatenate([keys, np.array([2**64 - 2], np.uint64)])  # a key of tag 255
    want = np.bincount((keys >> np.uint64(56)).astype(np.int64), minlength=256)
    assert by_tag(keys).tolist() == want.tolist() and by_tag(keys[:0]).sum() == 0


def test_each_tables_own_admission_in_the_pipeline_equals_the_reference(ray_local, tmp_path):
    """Lists get a row from their second batch on, ids expire after 2 batches unseen, the third
    table admits every key: MEM-PS's owners count each table's keys by their tag."""
    from hpsray.pipelines import SyntheticSource

    from small_pipeline import GEN as SMALL  # tests/small_pipeline.py
    from small_pipeline import small_config, small_pipeline

    lists = TableSpec("lists", (1,), 4, "mean", admit_after=2)
    ids = TableSpec("ids", (3,), 4, lr=0.2, expire_after_batches=2)
    cfg = small_config(minibatch_size=100, tables=(THREE[0], lists, ids))
    source = SyntheticSource(SMALL, rows=3000)
    with small_pipeline(source, cfg, mem_rows=2000, ssd_dir=tmp_path / "ssd", ssd_options=dict(rows_per_file=256)) as p:
        p.fit(progress=False)
        keys, rows = p.export_rows()
        dense = p.dense_state()
    ref = ReferenceTrainer(source.n_slots, source.n_dense, cfg)
    ref.fit(source.open(500))
    tables = ref.export_tables()
    ref_keys = np.concatenate([k for k, _ in tables.values()])
    order = np.argsort(ref_keys)
    np.testing.assert_array_equal(keys, ref_keys[order])
    np.testing.assert_array_equal(rows, np.concatenate([r for _, r in tables.values()])[order])
    for name, value in ref.dense_state().items():
        np.testing.assert_array_equal(dense[name].numpy(), value.numpy(), err_msg=name)
    admission = ref.admissions
    assert admission[0] is None and admission[1] is not None and admission[2] is not None


def test_admission_by_table_decides_as_one_admission_per_table():
    from hpsray.tables import tag_keys
    from hpsray.tiers.admission import Admission

    rng = np.random.default_rng(3)
    own = [(0, None), (3, None), (2, 2)]
    joint = Admission(per_table=own, capacity=16)
    alone = [Admission(a, e, capacity=16) for a, e in own]
    slot_table = np.array([0, 1, 2])
    for batch in range(12):
        raw = rng.integers(0, 60, 90).astype(np.uint64)
        keys = np.unique(tag_keys(raw, rng.integers(0, 3, raw.size), slot_table))
        tags = (keys >> np.uint64(56)).astype(np.int64)
        got = joint.see(batch, keys)
        for t, adm in enumerate(alone):
            assert np.array_equal(got[tags == t], adm.see(batch, keys[tags == t])), (batch, t)
        gone = joint.expire(batch)
        want = np.sort(np.concatenate([adm.expire(batch) for adm in alone]))
        assert np.array_equal(gone, want), batch
    assert joint.enabled and Admission(per_table=[(0, None), (1, None)]).enabled is False
    restored = Admission(per_table=own)
    restored.restore(joint.state())
    assert np.array_equal(restored.admitted(keys), joint.admitted(keys))
    with pytest.raises(ValueError, match="restored into"):
        Admission(per_table=[(0, None), (3, None), (2, 3)]).restore(joint.state())
