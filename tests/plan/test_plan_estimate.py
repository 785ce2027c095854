"""The plan's figures against the engines and exact counts, without Ray.

The pinned-rows rule is checked against :class:`hpsray.tiers.mem.MemPS` itself, driven in the
pipeline's order (``pull(t+1)`` before ``write_back(t)`` / ``unpin(t)``): the plan's number is the
smallest budget that trains every sampled batch, and one row less raises ``CapacityError``.
"""

import numpy as np
import pytest

from hpsray.data import PlantedCTR, write_synthetic
from hpsray.errors import CapacityError
from hpsray.job import JobConfig
from hpsray.plan import check_plan, make_plan
from hpsray.plan.estimate import estimate_keys
from hpsray.plan.sample import input_size, read_sample
from hpsray.tiers.mem import MemPS

from loading import pull_loaded  # tests/loading.py


class _Empty:
    width = 4

    def load(self, keys):
        return np.zeros((keys.size, self.width), np.float32), np.zeros(keys.size, bool)

    def dump(self, keys, rows):
        pass


def _job(tmp_path, **tables):
    d = {
        "data": {"synthetic": {"rows": 24_000, "slots": 6, "keys": 3000, "dense": 2, "seed": 5}},
        "model": {"dim": 4, "hidden": [8]},
        "optimizer": {"sparse": "sgd"},
        "pipeline": {"batch_size": 2000, "minibatch_size": 500},
        **tables,
    }
    return JobConfig.from_dict(d, where="job.toml", base_dir=str(tmp_path))


def _runs_in_pipeline_order(batch_keys, capacity):
    mem = MemPS(capacity, 4, _Empty())
    pull_loaded(mem, 0, batch_keys[0])
    for t in range(1, len(batch_keys)):
        pull_loaded(mem, t, batch_keys[t])  # submitted before write_back(t-1): batch t-1 is still pinned
        mem.unpin(t - 1)


def test_pinned_rows_are_the_memps_rule(tmp_path):
    sample = read_sample(_job(tmp_path), 24_000)
    need = estimate_keys(sample, 1).pinned_max
    _runs_in_pipeline_order(sample.batch_keys, need)
    with pytest.raises(CapacityError, match=f"{need} rows would have to be held"):
        _runs_in_pipeline_order(sample.batch_keys, need - 1)


def test_total_distinct_extrapolated_within_a_quarter(tmp_path):
    job = _job(tmp_path)
    exact = np.unique(np.concatenate(read_sample(job, 24_000).batch_keys)).size
    est = estimate_keys(read_sample(job, 8_000), 1, key_space=None)  # a third of the input, no cap
    assert est.total_examples == 24_000
    assert abs(est.total_distinct - exact) <= 0.25 * exact, (est.total_distinct, exact)


def test_two_nodes_split_the_pinned_rows_by_owner(tmp_path):
    one = estimate_keys(read_sample(_job(tmp_path), 24_000), 1)
    two = estimate_keys(read_sample(_job(tmp_path), 24_000), 2)
    assert len(two.pinned_max_per_node) == 2
    # a global batch of two nodes is two batches; each owner holds about half of its rows
    assert 0.4 * 2 * one.pinned_max < sum(two.pinned_max_per_node) < 1.1 * 2 * one.pinned_max


def test_a_budget_below_the_pinned_rows_is_an_error_naming_the_fix(tmp_path):
    plan = make_plan(_job(tmp_path, tiers={"mem_rows": 2000}), 6000, calibrate_stages=False)
    need = plan.keys.pinned_max
    assert [p.setting for p in plan.errors] == ["tiers.mem_rows"]
    with pytest.raises(CapacityError, match=f"set \\[tiers\\] mem_rows >= {need:,}"):
        check_plan(plan)
    by_bytes = make_plan(_job(tmp_path, tiers={"mem_bytes": "64 KiB"}), 6000, calibrate_stages=False)
    assert "set [tiers] mem_bytes >= " in by_bytes.errors[0].fix
    assert not make_plan(_job(tmp_path, tiers={"mem_rows": need}), 6000, calibrate_stages=False).errors


@pytest.mark.parametrize("fmt", ["criteo", "parquet"])
def test_input_size_of_files(tmp_path, fmt):
    gen = PlantedCTR(n_slots=3, keys_per_slot=500, n_dense=2, seed=1)
    write_synthetic(str(tmp_path / "d"), gen, 9_000, fmt, shard_rows=3_000)
    job = JobConfig.from_dict(
        {"data": {"paths": [str(tmp_path / "d")]}, "pipeline": {"batch_size": 1000, "minibatch_size": 500}},
        where=str(tmp_path / "job.toml"),
    )
    size = input_size(job)
    assert size.files == 3
    assert abs(size.rows - 9_000) <= (0 if fmt == "parquet" else 0.02 * 9_000), size
    sample = read_sample(job, 2_500)
    assert sample.examples == 3_000 and not sample.complete and sample.n_slots == 3
