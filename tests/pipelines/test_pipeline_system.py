"""The single-node system on real Ray actors: lossless against the reference, bounded, named."""

import json
import os
import sys
import time

import numpy as np
import pytest
import ray
import torch
from ray import cloudpickle

from hpsray.actors.cpu import thread_niceness
from hpsray.actors.trainer import Trainer
from hpsray.config import TrainConfig
from hpsray.data import Batch, PlantedCTR
from hpsray.errors import TrainingStopped
from hpsray.pipelines import SyntheticSource
from hpsray.pipelines.report import format_stage_table
from hpsray.reference import ReferenceTrainer
from hpsray.report import json_keys

from report_keys import check_fit_report  # tests/report_keys.py
from small_pipeline import CFG, GEN, small_config, small_pipeline  # tests/small_pipeline.py

SOURCE = SyntheticSource(GEN, rows=6000)
BATCH = 1000


def reference_of(cfg: TrainConfig, source=SOURCE) -> tuple:
    ref = ReferenceTrainer(source.n_slots, source.n_dense, cfg)
    ref.fit(source.open(BATCH))
    return ref.export()


@pytest.mark.parametrize(
    "optimizer,lr,devices",
    [("adagrad", 0.05, 2), ("adam", 0.01, 1)],
)
def test_pipeline_is_lossless_with_rows_travelling_to_ssd_and_back(ray_local, tmp_path, optimizer, lr, devices):
    cfg = small_config(hidden=(16,), minibatch_size=200, sparse_optimizer=optimizer, sparse_lr=lr)
    # 3000 rows of MEM-PS against ~5000 distinct keys, two batches pinned at a time: rows must
    # be evicted to SSD-PS and loaded back for later batches.
    with small_pipeline(
        SOURCE,
        cfg,
        mem_rows=3000,
        batch_size=BATCH,
        ssd_dir=tmp_path / "ssd",
        ssd_options=dict(rows_per_file=256),
        trainer=dict(n_devices=devices),
        read_queue=2,
    ) as p:
        report = p.fit(progress=False)
        keys, rows = p.export_rows()
        dense = p.dense_state()
    assert report["batches"] == 6 and report["examples"] == 6000
    assert report["ssd"]["bytes_read"] > 0, "the budget should have forced SSD loads"
    assert min(report["cache_hit_rate"].values()) < 1.0
    ref_keys, ref_rows, ref_dense = reference_of(cfg)
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def test_later_passes_reuse_the_reader_and_stay_lossless(ray_local):
    """fit, evaluate, fit again on more data: one reader actor serves every pass (a new actor
    costs seconds of process start), and the result is the reference's over both passes."""
    cfg = small_config(hidden=(16,), minibatch_size=200)
    second = SyntheticSource(GEN, rows=3000, start_row=6000)
    with small_pipeline(SOURCE, cfg, mem_rows=20000, batch_size=BATCH) as p:
        first_report = p.fit(progress=False)
        reader = p.actors()["Reader[node 0]"]
        evaluated = p.evaluate(SyntheticSource(GEN, rows=2000, start_row=10**7))
        p.source = second
        report = p.fit(progress=False)
        assert p.actors()["Reader[node 0]"]._actor_id == reader._actor_id
        keys, rows = p.export_rows()
        dense = p.dense_state()
    assert first_report["examples"] == 6000 and evaluated["examples"] == 2000
    assert report["examples"] == 3000 and report["batches"] == 3
    # the first pass waits for the actors' processes, outside its wall time; later ones do not
    assert report["startup_s"] < 0.5 < first_report["startup_s"]
    assert set(report["per_batch_s"]["read"]) == {"6", "7", "8"}
    ref = ReferenceTrainer(SOURCE.n_slots, SOURCE.n_dense, cfg)
    ref.fit(SOURCE.open(BATCH))
    ref.fit(second.open(BATCH))
    ref_keys, ref_rows, ref_dense = ref.export()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def test_an_interrupt_before_fit_stops_its_first_batch_and_the_next_fit_trains_on_losslessly(ray_local):
    """``Pipeline.interrupt()`` (what the first Ctrl-C calls) before ``fit()``: it stops at the first
    batch's end, rows written back; honoured once, so the next ``fit()`` trains the pass's other
    batches and the result is the reference's."""
    cfg = small_config(hidden=(16,), minibatch_size=200)
    with small_pipeline(SOURCE, cfg, mem_rows=20000, batch_size=BATCH) as p:
        p.interrupt()
        with pytest.raises(KeyboardInterrupt, match="stopped after 1 batches trained"):
            p.fit(progress=False)
        report = p.fit(progress=False)
        keys, rows = p.export_rows()
        dense = p.dense_state()
    assert report["batches"] == 5 and report["examples"] == 5000
    ref_keys, ref_rows, ref_dense = reference_of(cfg)
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


# Models defined here travel to Ray workers by value (workers cannot import test modules).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SlowDNN(torch.nn.Module):
    """A real model whose forward pass is slowed down, to make training the bottleneck."""

    def __init__(self, n_slots, dim, n_dense, delay_s):
        super().__init__()
        self.linear = torch.nn.Linear(n_slots * dim + n_dense, 1)
        self.delay_s = delay_s

    def forward(self, pooled, dense):
        time.sleep(self.delay_s)
        return self.linear(torch.cat([pooled.flatten(1), dense], 1)).squeeze(1)


def test_slow_trainer_stalls_the_reader(ray_local):
    cfg = CFG
    source = SyntheticSource(GEN, rows=8000)
    with small_pipeline(source, cfg, mem_rows=20000, trainer=dict(model=SlowDNN(4, 4, 3, 0.15)), read_queue=2) as p:
        report = p.fit(progress=False)
        reader_events = ray.get(p.actors()["Reader[node 0]"].stats.remote())["events"]
        trainer_events = ray.get(p.actors()["Trainer[node 0]"].stats.remote())["events"]
    assert report["batches"] == 16
    train_starts = sorted(start for start, _, _ in trainer_events)
    for start, _, batch in reader_events:
        trained = sum(s < start for s in train_starts)
        # read t may run while t-1 trains, t is pulled and the read queue (2) holds t+1, t+2
        assert batch - trained <= 2 + 2, f"read of batch {batch} ran with only {trained} batches in training"
    assert report["queues"]["read→pull"]["max_depth"] <= 2
    assert report["stage_busy_s"]["train"] > report["stage_busy_s"]["read"]


def test_the_trainer_starts_each_batch_on_inputs_fetched_while_the_one_before_trained(ray_local):
    """``Trainer.fetch_ahead`` (its second thread) fetches batch ``t``'s inputs and ``t+1``'s keys
    while ``t-1`` trains: the batches train on them (the results stay the reference's: every
    pipeline test that compares with it runs this path). A batch whose trainer is idle when it
    comes (the first) may start before its fetch and fetch its inputs itself."""
    source = SyntheticSource(GEN, rows=8000)
    with small_pipeline(source, CFG, mem_rows=20000, trainer=dict(model=SlowDNN(4, 4, 3, 0.05))) as p:
        report = p.fit(progress=False)
        stats = ray.get(p.actors()["Trainer[node 0]"].stats.remote())
    assert report["batches"] == 16
    assert stats["fetched_ahead"] >= 12  # of 16 (15 or 16 measured on an idle machine)


def test_the_report_of_a_real_fit_has_exactly_todays_keys(ray_local):
    """The JSON keys its readers use (``tests/report_keys.py``), from a real one-node ``fit()``:
    a key the typed report lost, or one it gained, fails here."""
    with small_pipeline(trainer=dict(stage_niceness=4)) as p:
        report = p.fit(progress=False)
        assert p.report is not None and report == p.report.as_dict()
        # the read, pull and load stages yield the cores to the trainer: every thread of theirs is nicer
        actors = p.actors()
        trainer = ray.get(actors["Trainer[node 0]"].__ray_call__.remote(lambda t: thread_niceness()))
        steps = p.trainer_settings.stage_niceness
        assert steps > 0
        for name in ("Reader[node 0]", "MemPS[node 0]", "SSDPS[node 0]"):  # Ray's threads too: each +steps
            niceness = ray.get(actors[name].__ray_call__.remote(lambda a: thread_niceness()))
            assert set(niceness) == {min(19, n + steps) for n in trainer}, (name, niceness, trainer)
        # index_stage "auto" on a node of 2 CPUs: the trainer makes the batch's index itself
        made = ray.get(p.actors()["Reader[node 0]"].__ray_call__.remote(lambda r: r.minibatch_size))
        assert made is None
    check_fit_report(report)
    assert set(report) <= json_keys()
    assert report["batches"] == 2 and report["examples"] == 1000
    start = report["start"]  # counted from the fit() call: the start's parts are inside it
    assert report["time_to_first_batch_s"] >= start["ray_init_s"] + start["actors_s"]
    assert set(report["stage_busy_s"]) == set(report["per_batch_s"]) == {"read", "pull", "load", "train"}
    # the busy seconds inside the timed wall: a fill before the clock counts in stage_busy_s only
    assert 0 < report["pipeline_efficiency"] <= min(1.0, max(report["stage_busy_s"].values()) / report["wall_s"]) + 1e-9
    busy, cpu = report["stage_busy_s"], report["stage_cpu_s"]
    assert set(cpu) == set(busy) and cpu["train"] > 0
    for stage, seconds in cpu.items():  # a process's threads use at most every core while it is busy
        assert 0 <= seconds <= busy[stage] * (os.cpu_count() or 1) + 0.05, (stage, seconds, busy[stage])
    assert "CPU/busy" in format_stage_table(report)
    json.dumps(report)  # plain JSON


def test_actors_are_named_for_the_dashboard(ray_local):
    cfg = CFG
    with small_pipeline(cfg=cfg, name="named-run") as p:
        p.fit(progress=False)
        names = set(ray.util.list_named_actors())
        assert {
            "named-run:MemPS[node 0]",
            "named-run:SSDPS[node 0]",
            "named-run:Trainer[node 0]",
            "named-run:Reader[node 0]",
        } <= names
    assert repr(Trainer(0, 1, cfg, 4, 3, capacity=100)) == "Trainer[node 0]"


def test_transform_stage_runs_in_the_reader(ray_local):
    cfg = CFG

    def only_first_slot(batch: Batch) -> Batch:
        keep = batch.slots == 0
        counts = np.bincount(batch.example_of_key()[keep], minlength=len(batch))
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return Batch(batch.labels, batch.dense, batch.keys[keep], offsets, batch.slots[keep], batch.n_slots)

    with small_pipeline(SyntheticSource(GEN, rows=2000), cfg, transforms=[only_first_slot], batch_size=1000) as p:
        p.fit(progress=False)
        keys, _ = p.export_rows()
    all_keys = np.unique(GEN.generate(2000).keys)
    first_slot = np.unique(GEN.generate(2000).keys[GEN.generate(2000).slots == 0])
    np.testing.assert_array_equal(keys, first_slot)
    assert keys.size < all_keys.size


def test_too_small_memory_budget_fails_clearly(ray_local):
    cfg = CFG
    # preflight=False: the actors meet the budget (fit()'s pre-flight plan refuses it first: test_first_hour_runs)
    with small_pipeline(SyntheticSource(GEN, rows=2000), cfg, mem_rows=50, batch_size=1000, preflight=False) as p:
        with pytest.raises(TrainingStopped, match="CapacityError"):
            p.fit(progress=False)


def test_evaluate_scores_held_out_rows(ray_local):
    cfg = small_config(dim=8, hidden=(32,))
    gen = PlantedCTR(n_slots=6, keys_per_slot=500, n_dense=3, seed=4)
    with small_pipeline(SyntheticSource(gen, rows=40_000), cfg, mem_rows=8000, batch_size=5000) as p:
        p.fit(progress=False)
        result = p.evaluate(SyntheticSource(gen, rows=5000, start_row=10**8))
    assert result["examples"] == 5000
    assert result["auc"] > 0.7


def test_bad_input_in_strict_mode_stops_training_but_keeps_what_was_trained(ray_local, tmp_path):
    from hpsray.data import STRICT, Schema
    from hpsray.errors import DataError
    from hpsray.pipelines import FileSource

    rng = np.random.default_rng(0)
    n = 3000
    lines = ["click,price,user,ad"]
    for _ in range(n):
        lines.append(f"{rng.integers(0, 2)},{rng.random():.3f},u{rng.integers(0, 300)},a{rng.integers(0, 50)}")
    lines[2501] = "1,not-a-number,u1,a1"  # inside the third batch of 1000
    path = tmp_path / "clicks.csv"
    path.write_text("\n".join(lines) + "\n")
    schema = Schema.from_dict(
        {"format": "csv", "header": True, "label": "click", "dense": ["price"], "categorical": ["user", "ad"]}
    )
    cfg = small_config(minibatch_size=250)
    # small parse blocks, so the first batches are read before the bad line is reached
    source = FileSource(str(path), schema, policy=STRICT, options={"block_size": 8192})
    # preflight=False: the readers meet the bad line (fit()'s pre-flight plan, as hpsray train's, would first)
    with small_pipeline(source, cfg, mem_rows=2000, batch_size=1000, read_queue=1, preflight=False) as p:
        with pytest.raises(TrainingStopped) as failure:
            p.fit(progress=False)
        assert isinstance(failure.value.cause.cause, DataError)
        assert failure.value.saved_batches == 2
        message = str(failure.value)
        assert "DataError" in message and "clicks.csv" in message and "line 2502" in message, message
        assert "2 batches trained before the failure" in message
        keys, rows = p.export_rows()
    # exactly the two good batches were trained and kept
    good = list(FileSource(str(path), schema).open(1000))[:2]
    ref = ReferenceTrainer(2, 1, cfg)
    ref.fit(good)
    ref_keys, ref_rows, _ = ref.export()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
