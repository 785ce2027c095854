"""JobConfig: the TOML job file of ``hpsray train``; every error names file, key and reason."""

import os

import pytest

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR, Schema, write_synthetic
from hpsray.errors import ConfigError
from hpsray.job import JobConfig, build
from hpsray.pipelines import FileSource, SyntheticSource

SYN = {"data": {"synthetic": {"rows": 1000}}}


def write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(d, where="job.toml"):
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(d, where=where, base_dir="/base")
    return str(e.value)


def with_(section, **kv):
    d = {"data": {"synthetic": {"rows": 1000}}}
    d.setdefault(section, {}).update(kv)
    return d


def test_the_message_names_file_key_and_reason():
    assert error_of(with_("pipeline", batch_size=-5)) == (
        "job.toml: pipeline.batch_size: must be a positive integer, got -5"
    )


@pytest.mark.parametrize(
    "d, key, reason",
    [
        # unknown keys, at each level
        ({**SYN, "pipelin": {}}, "pipelin", "unknown key"),
        (with_("pipeline", batch=5), "pipeline.batch", "unknown key"),
        (with_("tiers", ssd={"rows_per_fil": 4}), "tiers.ssd.rows_per_fil", "unknown key"),
        ({"data": {"synthetic": {"rows": 10, "slot": 3}}}, "data.synthetic.slot", "unknown key"),
        (
            with_("optimizer", sparse_params={"beta1": 0.9}),
            "optimizer.sparse_params.beta1",
            "not a parameter of the adagrad",
        ),
        # wrong types
        (with_("pipeline", batch_size="big"), "pipeline.batch_size", "must be a positive integer, got 'big'"),
        (with_("pipeline", batch_size=True), "pipeline.batch_size", "must be a positive integer"),
        (with_("pipeline", minibatch_size=1.5), "pipeline.minibatch_size", "must be a positive integer"),
        (with_("model", hidden=64), "model.hidden", "must be an array of positive integers"),
        (with_("optimizer", sparse_lr="fast"), "optimizer.sparse_lr", "must be a number"),
        (with_("tiers", ssd={"background": 1}), "tiers.ssd.background", "must be true or false"),
        (with_("cluster", address=5), "cluster.address", "must be a string"),
        ({"data": {"synthetic": {"rows": 1000}}, "model": 3}, "model", "must be a table"),
        # negative / out of range / bad choices
        (with_("model", dim=0), "model.dim", "must be a positive integer, got 0"),
        (with_("model", hidden=[64, -1]), "model.hidden", "positive integers"),
        (with_("optimizer", sparse_lr=-0.1), "optimizer.sparse_lr", "must be > 0, got -0.1"),
        (with_("optimizer", sparse="adadelta"), "optimizer.sparse", "must be one of sgd, adagrad, adagrad_row, adam"),
        (with_("tiers", mem_rows=-1), "tiers.mem_rows", "must be a positive integer, got -1"),
        (with_("tiers", mem_bytes="lots"), "tiers.mem_bytes", "byte count"),
        (with_("tiers", mem={"lru_fraction": 1.5}), "tiers.mem.lru_fraction", "must be in [0, 1], got 1.5"),
        (with_("tiers", ssd={"stale_threshold": 1.0}), "tiers.ssd.stale_threshold", "must be in (0, 1)"),
        (with_("tiers", ssd={"merge_small_files": 1}), "tiers.ssd.merge_small_files", "an integer >= 2, got 1"),
        (with_("pipeline", device="tpu"), "pipeline.device", "must be one of cpu, cuda"),
        (with_("pipeline", read_queue=0), "pipeline.read_queue", "must be a positive integer, got 0"),
        (with_("pipeline", load_queue=0), "pipeline.load_queue", "must be a positive integer, got 0"),
        (with_("tiers", dumps_in_flight=0), "tiers.dumps_in_flight", "must be a positive integer, got 0"),
        (with_("cluster", nodes=-2), "cluster.nodes", "must be a non-negative integer, got -2"),
        (with_("cluster", consistency="eventual"), "cluster.consistency", "must be one of"),
        (with_("cluster", staleness=-1), "cluster.staleness", "must be a non-negative integer, got -1"),
        (with_("cluster", dense_sync="ring"), "cluster.dense_sync", "must be one of"),
        (with_("cluster", propagation="gossip"), "cluster.propagation", "must be one of"),
        (with_("cluster", work_per_clock=0), "cluster.work_per_clock", "must be a positive integer, got 0"),
        (with_("cluster", dense_staleness=-1), "cluster.dense_staleness", "non-negative integer, got -1"),
        (
            {**with_("pipeline", n_devices=2), "cluster": {"consistency": "ssp"}},
            "cluster.consistency",
            "'ssp' needs pipeline.n_devices = 1",
        ),
        ({"data": {"synthetic": {"rows": 10, "eval_rows": -1}}}, "data.synthetic.eval_rows", "non-negative integer"),
        # contradictions
        (with_("tiers", mem_rows=10, mem_bytes=1000), "tiers.mem_bytes", "either tiers.mem_rows or tiers.mem_bytes"),
        (with_("pipeline", batch_size=100, minibatch_size=200), "pipeline.minibatch_size", "must not exceed"),
        ({"data": {"paths": ["x"], "synthetic": {"rows": 3}}}, "data.paths", "not both"),
        ({"data": {"paths": ["x"], "format": "csv", "schema": {"format": "parquet"}}}, "data.format", "contradicts"),
        (with_("tiers", ssd_path="s3://bucket/ssd"), "tiers.ssd_path", "must be a local directory"),
        # [checkpoint]
        (with_("checkpoint", every_batches=5), "checkpoint.dir", "missing (required)"),
        (with_("checkpoint", dir=""), "checkpoint.dir", "must not be empty"),
        (with_("checkpoint", dir=7), "checkpoint.dir", "must be a string, got integer 7"),
        (with_("checkpoint", dir="c", every_batches=0), "checkpoint.every_batches", "positive integer, got 0"),
        (with_("checkpoint", dir="c", every_batches=2.5), "checkpoint.every_batches", "positive integer"),
        (with_("checkpoint", dir="c", keep=0), "checkpoint.keep", "must be a positive integer, got 0"),
        (with_("checkpoint", dir="c", max_failures=-1), "checkpoint.max_failures", "non-negative integer, got -1"),
        (with_("checkpoint", dir="c", every=3), "checkpoint.every", "unknown key (known: dir, every_batches"),
        ({**SYN, "checkpoint": "ckpt"}, "checkpoint", "must be a table"),
        # missing values
        ({}, "data", "missing section"),
        ({"data": {}}, "data.paths", "missing"),
        ({"data": {"synthetic": {}}}, "data.synthetic.rows", "missing (required)"),
        ({"data": {"paths": []}}, "data.paths", "non-empty array"),
    ],
)
def test_bad_values_are_named(d, key, reason):
    msg = error_of(d)
    assert msg.startswith(f"job.toml: {key}: "), msg
    assert reason in msg, msg


def test_errors_from_nested_schema_and_bad_input_tables_carry_their_path():
    msg = error_of({"data": {"paths": ["x"], "schema": {"format": "csv", "label": 0, "delimitr": ","}}})
    assert msg.startswith("job.toml: data.schema.delimitr: unknown key"), msg
    msg = error_of({"data": {"paths": ["x"], "bad_input": {"mode": "loose"}}})
    assert msg.startswith("job.toml: data.bad_input.mode: must be 'strict' or 'lenient'"), msg


def test_load_reports_missing_files_and_toml_syntax(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml: no such file"):
        JobConfig.load(tmp_path / "nope.toml")
    p = write(tmp_path, "[pipeline\nbatch_size = 3\n")
    with pytest.raises(ConfigError, match=r"job\.toml: not valid TOML"):
        JobConfig.load(p)
    p = write(tmp_path, "[data.synthetic]\nrows = 100\n[pipeline]\nbatch_size = -5\n")
    with pytest.raises(ConfigError) as e:
        JobConfig.load(p)
    assert str(e.value) == f"{p}: pipeline.batch_size: must be a positive integer, got -5"
    assert e.value.key == "pipeline.batch_size" and isinstance(e.value, ValueError)


def test_relative_paths_resolve_against_the_job_files_directory(tmp_path, monkeypatch):
    sub = tmp_path / "jobs"
    sub.mkdir()
    write(
        sub,
        '[data]\npaths = ["data/train", "/abs/x.tsv", "s3://bucket/day=1/*.parquet"]\n'
        'eval_paths = "../held-out"\nformat = "criteo"\n[tiers]\nssd_path = "ssd"\n',
    )
    monkeypatch.chdir(tmp_path)  # not the job's directory
    job = JobConfig.load("jobs/job.toml")
    assert job.data.paths == (str(sub / "data" / "train"), "/abs/x.tsv", "s3://bucket/day=1/*.parquet")
    assert job.data.eval_paths == (str(tmp_path / "held-out"),)
    assert job.tiers.ssd_path == str(sub / "ssd")
    assert build.stages(job, n_slots=26)[2].path == str(sub / "ssd")


def test_defaults_and_the_pieces_it_builds():
    job = JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 5000, "eval_rows": 500, "slots": 3, "keys": 50, "dense": 2, "nnz": 4}},
            "model": {"dim": 4, "hidden": [8], "seed": 3},
            "optimizer": {"sparse": "adam", "sparse_lr": 0.01, "sparse_params": {"beta1": 0.8}, "dense": "sgd"},
            "tiers": {"mem_bytes": "1 MiB", "ssd": {"rows_per_file": 64, "max_space_ratio": False}},
            "pipeline": {"batch_size": 1000, "minibatch_size": 100, "n_devices": 2},
        },
        where="j.toml",
    )
    cfg = job.train_config()
    assert cfg == TrainConfig(
        dim=4,
        hidden=(8,),
        sparse_optimizer="adam",
        sparse_lr=0.01,
        dense_optimizer="sgd",
        dense_lr=1e-3,
        minibatch_size=100,
        seed=3,
        sparse_params={"beta1": 0.8},
    )
    src, ev = build.source(job), build.eval_source(job)
    assert isinstance(src, SyntheticSource) and src.rows == 5000 and src.n_slots == 3 and src.n_dense == 2
    assert ev.rows == 500 and ev.start_row == 5000 and repr(ev.generator) == repr(src.generator)
    trainer, mem, ssd = build.stages(job)
    assert trainer.n_devices == 2 and trainer.config == cfg
    assert mem.capacity_bytes == 2**20 and mem.capacity_rows is None
    assert ssd.path is None and ssd.options == {"rows_per_file": 64, "max_space_ratio": None}
    assert job.to_dict()["tiers"]["mem_bytes"] == 2**20
    # default MEM-PS budget: 4 batches' worth of slots, like Pipeline's own default
    job = JobConfig.from_dict(
        {"data": {"synthetic": {"rows": 10, "slots": 5}}, "pipeline": {"batch_size": 7, "minibatch_size": 7}}
    )
    assert build.stages(job)[1].capacity_rows == 4 * 7 * 5
    assert build.eval_source(job) is None


def test_schema_comes_from_the_table_the_data_directory_or_the_criteo_preset(tmp_path):
    gen = PlantedCTR(n_slots=3, keys_per_slot=20, n_dense=2, seed=1)
    write_synthetic(str(tmp_path / "data"), gen, 100, "parquet", shard_rows=50)
    job = JobConfig.from_dict(
        {"data": {"paths": ["data/part-0000[0].parquet"], "eval_paths": ["data/part-00001.parquet"]}},
        where="j.toml",
        base_dir=str(tmp_path),
    )
    src = build.source(job)
    assert isinstance(src, FileSource) and src.schema.format == "parquet" and src.n_slots == 3 and src.n_dense == 2
    assert build.eval_source(job).schema == src.schema
    # the directory itself works too
    job = JobConfig.from_dict({"data": {"paths": "data"}}, where="j.toml", base_dir=str(tmp_path))
    assert build.source(job).n_slots == 3
    # a format that contradicts _schema.toml is refused
    job = JobConfig.from_dict({"data": {"paths": "data", "format": "csv"}}, where="j.toml", base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"j\.toml: data\.format: 'csv' contradicts .*_schema\.toml"):
        build.source(job)
    # no _schema.toml: criteo preset, or an error naming data.schema
    (tmp_path / "raw").mkdir()
    job = JobConfig.from_dict({"data": {"paths": "raw", "format": "criteo"}}, where="j.toml", base_dir=str(tmp_path))
    assert build.source(job).schema == Schema.criteo()
    job = JobConfig.from_dict({"data": {"paths": "raw"}}, where="j.toml", base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"j\.toml: data\.schema: missing: no \[data\.schema\] table and no _schema"):
        build.source(job)
    # an explicit table wins
    job = JobConfig.from_dict(
        {"data": {"paths": "raw", "schema": {"format": "csv", "label": 0, "dense": [1], "categorical": [2, 3]}}},
        where="j.toml",
        base_dir=str(tmp_path),
    )
    assert build.source(job).n_slots == 2


def test_the_example_job_file_is_valid():
    here = os.path.dirname(os.path.abspath(__file__))
    job = JobConfig.load(os.path.join(here, "..", "..", "examples", "train.toml"))
    assert job.data.synthetic.rows > 0 and build.eval_source(job) is not None
    mem = build.stages(job)[1]
    assert mem.capacity_rows == job.tiers.mem_rows


def test_the_checkpoint_section_builds_the_checkpoint_stage(tmp_path, monkeypatch):
    from hpsray.job.sections import CheckpointSection
    from hpsray.pipelines import CheckpointSettings

    sub = tmp_path / "jobs"
    sub.mkdir()
    write(sub, '[data.synthetic]\nrows = 100\n[checkpoint]\ndir = "ckpt"\nevery_batches = 7\nkeep = 3\n')
    monkeypatch.chdir(tmp_path)  # not the job's directory
    job = JobConfig.load("jobs/job.toml")
    assert job.checkpoint == CheckpointSection(str(sub / "ckpt"), every_batches=7, keep=3, max_failures=3)
    assert job.to_dict()["checkpoint"] == {"dir": str(sub / "ckpt"), "every_batches": 7, "keep": 3, "max_failures": 3}
    assert build.checkpoint(job) == CheckpointSettings(str(sub / "ckpt"), 7, 3, 3, resume=False)
    assert build.checkpoint(job, resume=True).resume
    pipeline = build.pipeline(job, resume=True)  # no Ray yet: the actors start in fit()
    assert pipeline.checkpoint_settings == CheckpointSettings(str(sub / "ckpt"), 7, 3, 3, resume=True)
    job = JobConfig.from_dict(with_("checkpoint", dir="/abs/ckpt", max_failures=0), where="j.toml")
    assert job.checkpoint.dir == "/abs/ckpt" and job.checkpoint.max_failures == 0
    uri = "s3://bucket/ckpt?endpoint_override=minio:9000&scheme=http"  # object storage: checkpoint/remote.py
    assert JobConfig.from_dict(with_("checkpoint", dir=uri), where="j.toml").checkpoint.dir == uri
    # no section: no checkpoints, and nothing to resume from
    job = JobConfig.from_dict(SYN, where="j.toml")
    assert job.checkpoint is None and job.to_dict()["checkpoint"] is None and build.checkpoint(job) is None
    assert build.pipeline(job).checkpoint_settings is None
    with pytest.raises(ConfigError) as e:
        build.checkpoint(job, resume=True)
    assert str(e.value) == "j.toml: checkpoint.dir: missing: the job has no [checkpoint] dir to resume from"


def test_the_example_checkpoint_section_is_valid_once_uncommented(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "examples", "train.toml")) as f:
        lines = f.read().splitlines()
    start = lines.index("# [checkpoint]")
    block = [line[2:] for line in lines[start:] if line.startswith("# ")]
    text = "\n".join(lines[:start] + block) + "\n"
    job = JobConfig.load(write(tmp_path, text))
    assert job.checkpoint.dir == str(tmp_path / "ckpt") and job.checkpoint.every_batches == 50


def test_more_nodes_than_the_pipeline_supports_is_a_config_error():
    import inspect

    from hpsray.pipelines import Pipeline, SyncSettings

    job = JobConfig.from_dict(
        with_("cluster", nodes=3, consistency="ssp", staleness=1, dense_sync="chunked", chunk_bytes="64KiB"),
        where="j.toml",
    )
    assert build.cluster_kwargs(job) == {"nodes": 3, "sync": SyncSettings("ssp", 1, "chunked", 65536)}
    assert set(inspect.signature(Pipeline).parameters) >= {"nodes", "sync"}
    relaxed = JobConfig.from_dict(
        with_("cluster", consistency="absp", work_per_clock=8, dense_staleness=0, propagation="pull")
    )
    assert build.cluster_kwargs(relaxed)["sync"] == SyncSettings(
        "absp", work_per_clock=8, dense_staleness=0, propagation="pull"
    )
    assert build.cluster_kwargs(JobConfig.from_dict(with_("cluster", nodes=0)))["nodes"] is None  # every node
