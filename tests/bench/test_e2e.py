"""``hpsray bench e2e``: a tiny run reports every figure, per repeat and as medians, for the
main job, the small-batch case and the spill case."""

import argparse

import numpy as np

from hpsray.bench import e2e


def test_bench_e2e_reports_medians_of_alternating_repeats(ray_local):
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(
        [
            "--rows",
            "4000",
            "--warmup-rows",
            "1000",
            "--batch",
            "1000",
            "--minibatch",
            "250",
            "--slots",
            "4",
            "--keys",
            "500",
            "--hidden",
            "16",
            "--repeat",
            "2",
            "--small-batch-rows",
            "1500",
            "--small-batch",
            "500",
            "--small-batch-slots",
            "3",
            "--spill",
            "--spill-batch",
            "250",
        ]
    )
    out = e2e.run(args)
    assert len(out["runs"]) == 2
    for key in ("examples_per_s", "reference_examples_per_s", "ratio_vs_reference", "pipeline_efficiency"):
        values = [run[key] for run in out["runs"]]
        assert all(v > 0 for v in values), key
        assert out[key] == float(np.median(values)), key
    for run in out["runs"]:
        assert np.isclose(run["ratio_vs_reference"], run["examples_per_s"] / run["reference_examples_per_s"])
        assert 0 < run["pipeline_efficiency"] <= 1.0
    assert set(out["stage_busy_s"]) >= {"read", "pull", "train"}

    for key in ("small_batch_examples_per_s", "small_batch_reference_examples_per_s", "small_batch_ratio_vs_reference"):
        values = [run[key.removeprefix("small_batch_")] for run in out["small_batch_runs"]]
        assert len(values) == 2 and all(v > 0 for v in values), key
        assert out[key] == float(np.median(values)), key
    assert out["small_batch"] == {"rows": 1500, "batch": 500, "slots": 3}
    for key in ("spill_examples_per_s", "in_memory_examples_per_s", "spill_vs_in_memory", "spill_pipeline_efficiency"):
        values = [run[key] for run in out["spill_runs"]]
        assert len(values) == 2 and all(v > 0 for v in values), key
        assert out[key] == float(np.median(values)), key
    assert out["spill_budget_rows"] < out["spill_model_rows"]  # rows must travel to SSD-PS
    assert sum(run["spill_cache"]["evicted"] for run in out["spill_runs"]) > 0
