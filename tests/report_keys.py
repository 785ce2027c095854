"""The run report's JSON keys of today: the contract its readers rely on (the CLI's
``--report``/``--json``, the stage table, the benches, the tests). Used by ``tests/test_report.py``
(every section of :class:`~hpsray.report.RunReport`) and ``tests/pipelines/test_pipeline_system.py``
(a real ``fit()``)."""

from __future__ import annotations

# fit() on one node (with started_at, as fit() always has)
FIT_KEYS = {
    "mode",
    "nodes",
    "devices_per_node",
    "batches",
    "examples",
    "wall_s",
    "examples_per_s",
    "stage_busy_s",
    "stage_cpu_s",
    "pipeline_efficiency",
    "per_batch_s",
    "cache_hit_rate",
    "ssd",
    "cache",
    "loss",
    "queues",
    "overlap",
    "working_set",
    "bad_input",
    "time_to_first_batch_s",
    "startup_s",
    "start",
}
SEVERAL_NODES = {"sync", "per_node"}
SEVERAL_TABLES = {"tables"}  # a model of several tables: per table name, TABLE_KEYS
CHECKPOINTED = {"checkpoints", "recovery", "reshaped"}
EVALUATING = {"evaluations"}  # with [eval]: every evaluation while training, the best, stopped_early
# what hpsray train and hpsray demo add
COMMANDS = {
    "trainer",
    "auc",
    "logloss",
    "eval_examples",
    "export",
    "rows",
    "bad_rows",
    "config",
    "config_file",
    "resumed_from",
    "compare",
    "demo",
}
REFERENCE_KEYS = {
    "trainer",
    "mode",
    "nodes",
    "batches",
    "examples",
    "wall_s",
    "examples_per_s",
    "stage_busy_s",
    "pipeline_efficiency",
    "per_batch_s",
    "cache_hit_rate",
    "ssd",
    "loss",
    "bad_input",
    "auc",
    "logloss",
    "eval_examples",
    "rows",
}
SSD_KEYS = {
    "bytes_read",
    "bytes_written",
    "files",
    "disk_bytes",
    "live_bytes",
    "compactions",
    "load_seconds",
    "dump_seconds",
    "space_ratio",
}
EDGE_KEYS = {"capacity", "max_depth", "stalls"}
OVERLAP_KEYS = {"batches", "load_during_train", "read_load_train"}
START_KEYS = {"ray_init_s", "actors_s", "other_s", "ready_s"}
SYNC_KEYS = {
    "consistency",
    "staleness_bound",
    "propagation",
    "max_staleness_observed",
    "max_staleness_across_batches",
    "max_owner_staleness",
    "dense",
    "exchanged_bytes_per_minibatch",
}
PER_NODE_KEYS = {"node", "stage_busy_s", "examples", "cache"}
TABLE_KEYS = {
    "row_bytes",
    "lookups",
    "hits",
    "hit_rate",
    "ssd_rows_loaded",
    "ssd_bytes_loaded",
    "rows_created",
    "bytes_created",
    "ssd_live_rows",
    "ssd_live_bytes",
}
DEMO_KEYS = {"distinct_keys", "mem_rows", "rows_evicted", "rows_loaded_from_ssd"}


def check_fit_report(report: dict) -> None:
    """``report`` (a JSON form) has the keys of a one-node ``fit()`` without checkpoints, each
    section its own."""
    assert set(report) == FIT_KEYS, set(report) ^ FIT_KEYS
    assert set(report["ssd"]) == SSD_KEYS
    assert report["queues"] and all(set(q) == EDGE_KEYS for q in report["queues"].values())
    assert set(report["overlap"]) == OVERLAP_KEYS
    assert set(report["start"]) == START_KEYS
