"""The first hour of a new user (issue 48), part two: the Python API checks what ``hpsray
train`` checks, re-runs say how to start over, a bad row is reported once, logs without a
terminal carry no colour codes, a resumed run's tables and counters go on, the report's
figures say what they are."""

import io
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.errors import CapacityError, CheckpointError, ConfigError

GEN = PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=2, seed=1)
CFG = TrainConfig(dim=4, hidden=(8,), minibatch_size=500)


def pipeline(tmp_path, mem_rows=20_000, **kwargs):
    from hpsray.pipelines import MemPSSettings, Pipeline, SSDPSSettings, SyntheticSource, TrainerSettings

    return Pipeline(
        SyntheticSource(GEN, rows=4000),
        TrainerSettings(CFG),
        MemPSSettings(capacity_rows=mem_rows),
        SSDPSSettings(str(tmp_path / "ssd")),
        batch_size=1000,
        **kwargs,
    )


def test_the_python_api_runs_the_plans_capacity_check_before_any_actor(tmp_path):
    """The README's example stopped after 36 s with CapacityError from its own settings: fit()
    now refuses at once with the plan's message, naming the Python setting."""
    p = pipeline(tmp_path, mem_rows=100)
    with pytest.raises(CapacityError) as e:
        p.fit(progress=False)
    message = str(e.value)
    assert "the job cannot fit" in message and "two consecutive batches of 1,000 examples pin up to" in message
    assert "set MemPSSettings(capacity_rows=...) >= " in message and "[tiers]" not in message
    assert not p._nodes  # no actor started
    from hpsray.pipelines.preflight import preflight

    preflight(pipeline(tmp_path))  # a budget that fits passes
    with pytest.raises(CapacityError):  # the CLI's switch: hpsray train checks before Ray, then turns it off
        preflight(pipeline(tmp_path, mem_rows=100, preflight=False))
    p = pipeline(tmp_path, mem_rows=100, preflight=False)
    assert p.preflight is False


def test_the_python_api_refuses_an_earlier_runs_checkpoints_and_ssd_files(tmp_path):
    from hpsray.pipelines import CheckpointSettings
    from hpsray.pipelines.preflight import clear_checkpoints, clear_ssd, preflight

    ckpt = tmp_path / "ckpt"
    (ckpt / "ckpt-000004").mkdir(parents=True)
    (ckpt / "ckpt-000004" / "CHECKPOINT.json").write_text("{}")
    (ckpt / "notes.txt").write_text("mine")
    p = pipeline(tmp_path, checkpoint=CheckpointSettings(str(ckpt), every_batches=2))
    with pytest.raises(CheckpointError, match=r"holds checkpoints of .*ckpt-000004.*clear_checkpoints"):
        p.fit(progress=False)
    assert clear_checkpoints(str(ckpt)) == ["ckpt-000004"] and os.listdir(ckpt) == ["notes.txt"]
    (tmp_path / "ssd" / "node-0").mkdir(parents=True)
    (tmp_path / "ssd" / "node-0" / "params-0").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"SSDPSSettings.path: .*already holds parameter files .*node-0"):
        preflight(p)
    assert clear_ssd(str(tmp_path / "ssd")) == ["node-0"]
    preflight(p)


def test_a_missing_column_of_a_file_source_is_refused_by_fit(tmp_path):
    from hpsray.data import Schema
    from hpsray.pipelines import FileSource, Pipeline

    (tmp_path / "c.csv").write_text("click,price,user\n1,2.0,u1\n")
    schema = Schema(format="csv", header=True, label="clicked", dense=("price",), categorical=("user",))
    p = Pipeline(FileSource([str(tmp_path / "c.csv")], schema), batch_size=10)
    with pytest.raises(
        ConfigError, match=r"data.schema.label: column 'clicked' is not in .*c.csv.*did you mean 'click'"
    ):
        p.fit(progress=False)


def write_csv_job(tmp_path, bad_row=False):
    rows = ["click,price,user,ad"] + [f"{i % 2},{i % 5}.5,u{i % 37},a{i % 13}" for i in range(600)]
    if bad_row:
        rows.append("1,abc,u1,a1")
    (tmp_path / "clicks.csv").write_text("\n".join(rows) + "\n")
    job = tmp_path / "job.toml"
    job.write_text(
        textwrap.dedent("""
        [data]
        paths = ["clicks.csv"]
        [data.schema]
        format = "csv"
        header = true
        label = "click"
        dense = ["price"]
        categorical = ["user", "ad"]
        [model]
        dim = 4
        hidden = [8]
        [tiers]
        ssd_path = "ssd"
        [pipeline]
        batch_size = 200
        minibatch_size = 100
        [checkpoint]
        dir = "ckpt"
        """)
    )
    return job


def train(*args):
    from hpsray.__main__ import main

    return main(["train", *args])


def test_a_rerun_names_overwrite_with_the_exact_command_and_overwrite_starts_over(tmp_path, capsys):
    job = write_csv_job(tmp_path)
    (tmp_path / "ssd" / "node-0").mkdir(parents=True)
    (tmp_path / "ssd" / "node-0" / "params-0").write_bytes(b"x")
    assert train(str(job), "--quiet") == 2
    err = capsys.readouterr().err
    assert "already holds parameter files of an earlier run (node-0); add --overwrite" in err
    assert f"to start over: hpsray train {job} --overwrite" in err
    export = tmp_path / "export"
    assert train(str(job), "--reference", "--quiet", "--export", str(export)) == 0  # the reference: no Ray
    (export / "point").mkdir()  # what hpsray serve writes into an export
    capsys.readouterr()
    assert train(str(job), "--reference", "--quiet", "--export", str(export)) == 2
    err = capsys.readouterr().err
    assert f"--export {export}: holds an earlier export" in err and "add --overwrite to replace it" in err
    assert (export / "point").is_dir()  # refused: nothing replaced
    assert train(str(job), "--reference", "--quiet", "--export", str(export), "--overwrite") == 0
    assert (export / "manifest.json").is_file() and not (export / "point").exists()
    assert (tmp_path / "ssd" / "node-0").is_dir()  # --reference uses no SSD-PS: its files stay
    assert train(str(job), "--resume", "--overwrite") == 2
    assert "choose one" in capsys.readouterr().err


def test_overwrite_removes_only_what_a_run_left(tmp_path, capsys):
    from hpsray.cli.train import overwrite
    from hpsray.job import JobConfig

    job = JobConfig.load(write_csv_job(tmp_path))
    for d in ("ssd/node-0", "ssd/keep", "ckpt/ckpt-000002", "ckpt/.ckpt-000004.tmp-ab12", "export"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "f").write_text("x")
    overwrite(job, str(tmp_path / "export"), quiet=False)
    assert sorted(os.listdir(tmp_path / "ssd")) == ["keep"] and os.listdir(tmp_path / "ckpt") == []
    assert not (tmp_path / "export").exists()
    assert "--overwrite: removed" in capsys.readouterr().err


def test_the_plans_sample_does_not_report_bad_rows_the_readers_report(tmp_path, caplog):
    """Each bad row was printed twice: by the pre-flight plan, then by the Reader actor (whose
    warm-up read printed it once more)."""
    from hpsray.actors.reader import Reader
    from hpsray.cli.train import check_capacity
    from hpsray.job import JobConfig, build

    job = JobConfig.load(write_csv_job(tmp_path, bad_row=True))
    with caplog.at_level(logging.WARNING, logger="hpsray.data"):
        check_capacity(job, quiet=True)
        assert not [r for r in caplog.records if "bad input" in r.getMessage()]
        reader = Reader(build.source(job), 1000)  # the actor's class, in this process
        assert not [r for r in caplog.records if "bad input" in r.getMessage()]  # its warm-up is silent
        reader._it = iter(reader._data_reader)  # read the pass without the object store
        list(reader._it)
    bad = [r for r in caplog.records if "skipping bad input" in r.getMessage()]
    assert len(bad) == 1 and "line 602" in bad[0].getMessage()


def test_logs_without_a_terminal_carry_no_colour_codes_nor_the_token_notice(monkeypatch):
    from hpsray.cli.start import tidy_ray_logs

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    tidy_ray_logs(io.StringIO())  # not a terminal
    assert os.environ["RAY_COLOR_PREFIX"] == "0"  # the workers' line prefixes, as the driver prints them
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    worker, auth = (
        logging.getLogger("ray._private.worker"),
        logging.getLogger("ray._private.authentication.authentication_token_setup"),
    )
    for logger in (worker, auth):
        logger.addHandler(handler)
    try:
        worker.warning("View the dashboard at %s%s", "\x1b[1m\x1b[32mhttp://127.0.0.1:8265", "\x1b[39m\x1b[22m")
        auth.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
    finally:
        for logger in (worker, auth):
            logger.removeHandler(handler)
    assert out.getvalue() == "View the dashboard at http://127.0.0.1:8265\n"


def test_a_resumed_runs_stage_table_and_plots_cover_its_batches():
    """After --resume the batch ids start at the checkpoint's count: the table printed nan."""
    from hpsray.pipelines.report import _series, format_stage_table

    per = {s: {str(b): 0.01 * (b - 59) for b in range(60, 65)} for s in ("read", "pull", "load", "train")}
    report = {"wall_s": 1.0, "batches": 4, "examples": 400, "stage_busy_s": dict.fromkeys(per, 0.1), "per_batch_s": per}
    table = format_stage_table(report)
    assert "nan" not in table
    assert "0.025" in table.splitlines()[1] and _series(per["read"], 4)[0] == [60, 61, 62, 63]  # the extra read: out


def test_a_resumed_pass_continues_the_progress_counters(caplog):
    from hpsray.pipelines.progress import Progress

    with caplog.at_level(logging.INFO, logger="hpsray.progress"):
        bar = Progress(1000, True, seconds=0.0, first_batch=6, done_batches=6, done_examples=600)
        bar.bar.disable = True
        bar.begin()
        for _ in range(4):
            bar.update(100)
        bar.pass_end()
        bar.close()
    assert (bar.batches, bar.examples) == (10, 1000)
    assert "batches 10, examples 1,000/1,000 (100%)" in caplog.text


def test_the_ssd_plot_says_what_it_draws():
    from hpsray.pipelines.report import ssd_io_labels

    title, ylabel, caption = ssd_io_labels(
        {"ssd": {"bytes_read": 2048, "bytes_written": 4096, "load_seconds": 0.5, "dump_seconds": 0.25}}
    )
    assert "load stage" in title and "seconds" in ylabel
    assert caption == "SSD-PS in all: 2.0 KiB read in 0.50 s, 4.0 KiB written in 0.25 s"


def test_time_to_first_batch_counts_from_the_process_age():
    """The origin was /proc's boot time plus the process's start ticks: a clock step at boot
    shifted it (64.9 s reported for a 15 s start). Now: now minus the process's age."""
    before = time.time()
    code = (
        "import time; time.sleep(1.0); from hpsray.cli.train import process_age_s, process_start; "
        "print(process_age_s(), process_start(), time.time())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    age, start, now = (float(x) for x in out.stdout.split())
    after = time.time()
    assert 1.0 <= age <= now - before + 0.05  # at least the sleep, at most since the parent spawned it
    assert before - 0.05 <= start <= after and math.isclose(start, now - age, abs_tol=0.05)


def test_serve_metrics_are_prometheus_text():
    from hpsray.serving.metrics import ServeMetrics

    m = ServeMetrics()
    m.observe(200, 64, 0.004)
    m.observe(200, 16, 0.3)
    m.observe(400, 0, 0.0005)
    text = m.exposition({"rows": 1000, "delta": 0, "cache": {"hits": 7, "hit_rate": 0.5}, "directory": "/x"}, 2, "42")
    lines = text.splitlines()
    assert 'hpsray_serve_requests_total{replica="42",code="200"} 2' in lines
    assert 'hpsray_serve_requests_total{replica="42",code="400"} 1' in lines
    assert 'hpsray_serve_examples_total{replica="42"} 80' in lines
    assert 'hpsray_serve_request_seconds_bucket{replica="42",le="0.001"} 1' in lines
    assert 'hpsray_serve_request_seconds_bucket{replica="42",le="0.005"} 2' in lines  # cumulative
    assert 'hpsray_serve_request_seconds_bucket{replica="42",le="+Inf"} 3' in lines
    assert 'hpsray_serve_request_seconds_count{replica="42"} 3' in lines
    assert 'hpsray_serve_swaps_total{replica="42"} 2' in lines
    assert 'hpsray_serve_model_cache_hit_rate{replica="42"} 0.5' in lines and "directory" not in text
    for line in lines:  # every sample line: name{labels} number
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
            assert re.fullmatch(r'[a-z_]+\{[a-z]+="[^"]*"(,[a-z]+="[^"]*")*\}', name), line
